"""Full HF-named tensors from a sharded Megatron model: weight sync and HF export walk the same code.

`export_hf` walks this rank's pipeline stage (all its virtual chunks), gathers the tensor-parallel
parameters' shards onto tp_rank 0 of the stage (in flat batches, one collective each), rebuilds each full
tensor (`convert.sharding.unshard`: fused gate/up re-ordered, vocabulary padding cut) and converts it with
the family's rules. Only the stage's source rank (tp_rank 0, dp_rank 0, cp_rank 0) yields; the other ranks
of its TP group take part in the gathers and yield nothing; ranks of other data-parallel replicas return at
once, except under expert parallelism: the routed experts live on EP ranks that are data-parallel ranks
0..EP-1, so those take part in the expert gathers. Expert tensors go in their own flat batches: gathered over
the TP group (experts are sharded over TP, ETP = TP) and then over the EP group, so the source holds at most
one batch of every EP rank's experts at a time, and yields them with their model-wide HF names.
"""

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from userrl_megatron.convert.hf_io import ShardWriter, publish, staging_dir
from userrl_megatron.convert.rules import Converter, Split
from userrl_megatron.convert.sharding import unshard
from userrl_megatron.megatron.model import is_expert_parameter, named_global_parameters, with_expert
from userrl_megatron.megatron.parallel import Layout


def _detach(param: torch.nn.Parameter) -> torch.Tensor:
    return param.detach()


# Tensor-parallel shards are gathered in flat batches of about this size: one collective per batch instead
# of one per parameter (per-call overhead dominated the export of small and mid-size models on gloo).
GATHER_BATCH_BYTES = 16 * 1024 * 1024


def export_hf(
    chunks: list[torch.nn.Module],
    converter: Converter,
    layout: Layout,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = _detach,
    everywhere: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of `tensor_of(param)` for every parameter of the (unwrapped) chunks.

    Collective inside the stage's TP group: every rank must exhaust the iterator. A tied LM head is skipped.
    `everywhere` (every rank of the stage must pass the same): every rank of the stage, whatever its data- or
    context-parallel rank, yields the same tensors (shards all-gathered over TP, experts over EP), for colocated
    weight sync, where each rank hands the engine on its own GPU a handle to its own copy.
    """
    if not everywhere and (layout.cp_rank != 0 or layout.dp_rank >= layout.ep):
        return
    dense = everywhere or layout.dp_rank == 0  # else the other ranks here only hold experts of the source's EP group
    tp_group = parallel_state.get_tensor_model_parallel_group()
    root = torch.distributed.get_global_rank(tp_group, 0)
    arch = converter.arch
    batch: list[tuple[str, Split, torch.Tensor]] = []
    experts: list[tuple[str, Split, torch.Tensor]] = []
    size = expert_size = 0
    for name, param in named_global_parameters(chunks):
        if arch.tied_embeddings and name == "output_layer.weight":
            continue
        split = converter.split_of(name)
        local = tensor_of(param)
        if is_expert_parameter(name):
            if experts and (local.dtype != experts[-1][2].dtype or expert_size + _nbytes(local) > GATHER_BATCH_BYTES):
                yield from _gathered_experts(experts, converter, layout, tp_group, root, everywhere)
                experts, expert_size = [], 0
            experts.append((name, split, local))
            expert_size += _nbytes(local)
            continue
        if not dense:
            continue
        if layout.tp == 1 or split is Split.REPLICATED:
            if layout.tp_rank == 0 or everywhere:
                yield from converter.to_hf(name, unshard([local], split, rows=arch.vocab_size))
            continue
        if batch and (local.dtype != batch[-1][2].dtype or size + _nbytes(local) > GATHER_BATCH_BYTES):
            yield from _gathered(batch, converter, layout, tp_group, root, everywhere)
            batch, size = [], 0
        batch.append((name, split, local))
        size += _nbytes(local)
    if batch:
        yield from _gathered(batch, converter, layout, tp_group, root, everywhere)
    if experts:
        yield from _gathered_experts(experts, converter, layout, tp_group, root, everywhere)


def _gathered_experts(
    batch: list[tuple[str, Split, torch.Tensor]],
    converter: Converter,
    layout: Layout,
    tp_group: Any,
    tp_root: int,
    everywhere: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather a batch of expert parameters over TP (full experts) and then over EP (every EP rank's experts);
    the source rank (with `everywhere`, every rank) yields their HF tensors, expert indices shifted to each EP
    rank's experts."""
    full = list(_tp_gathered(batch, layout, tp_group, tp_root, everywhere)) if layout.tp > 1 else batch
    if not full:
        return
    buffers = None
    if layout.ep > 1:
        ep_group = parallel_state.get_expert_model_parallel_group()
        flat = torch.cat([tensor.reshape(-1) for _, _, tensor in full])
        if everywhere:
            buffers = [torch.empty_like(flat) for _ in range(layout.ep)]
            torch.distributed.all_gather(buffers, flat, group=ep_group)
        else:
            buffers = [torch.empty_like(flat) for _ in range(layout.ep)] if layout.ep_rank == 0 else None
            ep_root = torch.distributed.get_global_rank(ep_group, 0)
            torch.distributed.gather(flat, buffers, dst=ep_root, group=ep_group)
        if buffers is None or (layout.dp_rank != 0 and not everywhere):
            return
    per_rank = converter.arch.num_experts // layout.ep
    for ep_rank in range(layout.ep):
        # `name` holds this rank's expert index; EP rank r holds experts r * per_rank .. (r + 1) * per_rank - 1
        def renumber(e: int, r: int = ep_rank) -> int:
            return e + (r - layout.ep_rank) * per_rank

        offset = 0
        for name, _, tensor in full:
            n = tensor.numel()
            value = tensor if buffers is None else buffers[ep_rank][offset : offset + n].view(tensor.shape)
            offset += n
            shifted = with_expert(name, renumber)
            yield from converter.to_hf(shifted, value)


def _gathered(
    batch: list[tuple[str, Split, torch.Tensor]],
    converter: Converter,
    layout: Layout,
    group: Any,
    root: int,
    everywhere: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather a batch of TP-sharded parameters with one collective; tp_rank 0 (every rank with `everywhere`)
    yields their HF tensors."""
    for name, _, full in _tp_gathered(batch, layout, group, root, everywhere, rows=converter.arch.vocab_size):
        yield from converter.to_hf(name, full)


def _tp_gathered(
    batch: list[tuple[str, Split, torch.Tensor]],
    layout: Layout,
    group: Any,
    root: int,
    everywhere: bool,
    rows: int | None = None,
) -> Iterator[tuple[str, Split, torch.Tensor]]:
    """(name, split, full tensor) of each TP-sharded parameter of a batch, on tp_rank 0 (every rank with
    `everywhere`); nothing elsewhere. Every rank of the group holds shards of the same shapes, so one flat
    buffer per rank lines them up: one collective. `rows`: the real vocabulary of VOCAB tensors."""
    flat = torch.cat([local.reshape(-1) for _, _, local in batch])
    buffers: list[torch.Tensor] | None
    if everywhere:
        buffers = [torch.empty_like(flat) for _ in range(layout.tp)]
        torch.distributed.all_gather(buffers, flat, group=group)
    else:
        buffers = [torch.empty_like(flat) for _ in range(layout.tp)] if layout.tp_rank == 0 else None
        torch.distributed.gather(flat, buffers, dst=root, group=group)
    if buffers is None:
        return
    offset = 0
    for name, split, local in batch:
        n = local.numel()
        shards = [buffer[offset : offset + n].view(local.shape) for buffer in buffers]
        offset += n
        yield name, split, unshard(shards, split, rows=rows)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def export_hf_dir(
    chunks: list[torch.nn.Module],
    converter: Converter,
    layout: Layout,
    out_dir: str | Path,
    metadata_source: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> int:
    """Write the model as an HF directory at `out_dir` (collective over every rank); returns the most bytes of
    tensors this rank held for it at once. Each pipeline stage's source
    rank streams its own tensors into its own safetensors shards, holding at most one shard; global rank 0 then
    names the shards, writes the index and the metadata, and publishes the directory atomically. No rank ever
    holds the whole model. The directory must be on a file system every stage's source rank can write."""
    out = Path(out_dir)
    first = torch.distributed.get_rank() == 0
    staging = [str(staging_dir(out)) if first else None]
    torch.distributed.broadcast_object_list(staging, src=0)
    assert staging[0] is not None  # rank 0's staging directory, broadcast to every rank
    folder = Path(staging[0])
    writer = ShardWriter(folder, f"stage{layout.pp_rank:03d}", max_shard_bytes, dtype)
    for name, tensor in export_hf(chunks, converter, layout):
        writer.add(name, tensor)
    files = writer.close()  # [] on the ranks that are no stage's source
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (layout.pp_rank, files))
    if first:
        try:
            ordered = [f for _, stage_files in sorted(everyone, key=lambda e: e[0]) for f in stage_files]
            publish(folder, ordered, out, metadata_source, dtype)
        finally:
            if folder.exists():
                shutil.rmtree(folder)
    torch.distributed.barrier()  # the directory is complete when any rank returns
    return writer.peak_bytes
