"""HF-named tensors from a sharded Megatron model: weight sync and HF export walk the same code.

`export_plans` walks this rank's pipeline stage (all its virtual chunks), gathers the tensor-parallel
parameters' shards onto tp_rank 0 of the stage (in batches: each other rank sends every shard of a batch from its
own memory into its place in a buffer tp_rank 0 reuses from batch to batch, while tp_rank 0's own shards stay
where they are) and hands out each HF tensor as a `TensorPlan`: views of the shards (fused QKV and gate/up split,
vocabulary padding cut by the family's rules, `Converter.plans`), never a rebuilt full tensor.
Weight sync fills each plan straight into its place in the flat bucket: one copy per byte on TP=1 (parameter ->
bucket), the gather and one copy on TP>1. `export_hf` materializes the plans for callers that keep tensors
(the HF directory, gradients in tests, checksums).

Only the stage's source rank (tp_rank 0, dp_rank 0, cp_rank 0) yields; the other ranks of its TP group take
part in the gathers and yield nothing; ranks of other data-parallel replicas return at once, except under expert
parallelism: the routed experts live on EP ranks that are data-parallel ranks 0..EP-1, so those take part in
the expert gathers. Expert tensors go in their own flat batches: gathered over the TP group (experts are sharded
over TP, ETP = TP) and the gathered batch then over the EP group, so the source holds at most one batch of every
EP rank's experts at a time, and yields them with their model-wide HF names.
"""

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from userrl_megatron.convert.assembly import TensorPlan
from userrl_megatron.convert.hf_io import ShardWriter, publish, staging_dir
from userrl_megatron.convert.rules import Converter, Split
from userrl_megatron.megatron.model import is_expert_parameter, named_global_parameters, with_expert
from userrl_megatron.megatron.parallel import Layout


def _detach(param: torch.nn.Parameter) -> torch.Tensor:
    return param.detach()


# Tensor-parallel shards are gathered in batches of about this size, each batch's transfers posted together
# and awaited once (a blocking collective per parameter cost more than the bytes for small and mid-size models).
GATHER_BATCH_BYTES = 16 * 1024 * 1024


# torch >= 2.13 names it all_gather_single; the GPU machines' 2.11 has only the older name.
_all_gather_flat = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


class _Gather:
    """Gathers a flat batch from every rank of a group into buffers reused from batch to batch, on the group's
    rank 0 (on every rank with `everywhere`)."""

    def __init__(self, group: Any, size: int, everywhere: bool) -> None:
        self.group, self.size, self.everywhere = group, size, everywhere
        self.root = torch.distributed.get_global_rank(group, 0)
        self.receives = everywhere or torch.distributed.get_rank(group) == 0
        self._buffers = {"send": torch.empty(0), "recv": torch.empty(0)}

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors back to back in the reused send buffer."""
        n = sum(t.numel() for t in tensors)
        flat = _room(self._buffers, "send", n, tensors[0])[:n]
        for target, t in zip(_views(flat, tensors), tensors, strict=True):
            target.copy_(t)
        return flat

    def __call__(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `flat` (all the same size) in rank order, on the receiving ranks; None elsewhere."""
        n = flat.numel()
        out = _room(self._buffers, "recv", self.size * n, flat)[: self.size * n] if self.receives else None
        if self.everywhere:  # into one tensor: a list of outputs costs NCCL a flat copy of them all
            _all_gather_flat(out, flat, group=self.group)
        else:
            parts = [out[r * n : (r + 1) * n] for r in range(self.size)] if out is not None else None
            torch.distributed.gather(flat, parts, dst=self.root, group=self.group)
        return out

    def shards(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]] | None:
        """Every rank's `tensors` (rank order; each rank's list alike in shapes), on the receiving ranks. The other
        ranks send each tensor from its own memory into its place in a buffer rank 0 reuses, and rank 0's own
        shards are its tensors as they are: no copy on either side of the transfer."""
        if self.everywhere:
            gathered = self(self.pack(tensors))
            assert gathered is not None
            n = gathered.numel() // self.size
            return [_views(gathered[r * n : (r + 1) * n], tensors) for r in range(self.size)]
        if not self.receives:
            _wait_all(
                [
                    torch.distributed.P2POp(torch.distributed.isend, t.contiguous(), group=self.group, group_peer=0)
                    for t in tensors
                ]
            )
            return None
        n = sum(t.numel() for t in tensors)
        received = _room(self._buffers, "recv", (self.size - 1) * n, tensors[0])
        slots = [_views(received[(r - 1) * n : r * n], tensors) for r in range(1, self.size)]
        _wait_all(
            [
                torch.distributed.P2POp(torch.distributed.irecv, view, group=self.group, group_peer=r)
                for r, views in enumerate(slots, start=1)
                for view in views
            ]
        )
        return [tensors, *slots]


def _wait_all(ops: list[torch.distributed.P2POp]) -> None:
    """Run point-to-point transfers together (one launch on NCCL) and wait for all of them."""
    for work in torch.distributed.batch_isend_irecv(ops):
        work.wait()


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into consecutive views shaped like each of `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _room(buffers: dict[str, torch.Tensor], key: str, n: int, like: torch.Tensor) -> torch.Tensor:
    """`buffers[key]` if it holds `n` elements of `like`'s dtype on its device, else a new one made after the old
    one is dropped (so the two never coexist)."""
    buffer = buffers[key]
    if buffer.numel() >= n and buffer.dtype == like.dtype and buffer.device == like.device:
        return buffer
    del buffer
    buffers[key] = torch.empty(0)
    buffers[key] = torch.empty(n, dtype=like.dtype, device=like.device)
    return buffers[key]


def export_plans(
    chunks: list[torch.nn.Module],
    converter: Converter,
    layout: Layout,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = _detach,
    everywhere: bool = False,
) -> Iterator[tuple[str, TensorPlan]]:
    """(HF name, plan) of `tensor_of(param)` for every parameter of the (unwrapped) chunks.

    Collective inside the stage's TP group: every rank must exhaust the iterator. A plan must be consumed
    before the next one is asked for (gathered plans are transient). A tied LM head is skipped.
    `everywhere` (every rank of the stage must pass the same): every rank of the stage, whatever its data- or
    context-parallel rank, yields the same tensors (shards all-gathered over TP, experts over EP), for colocated
    weight sync, where each rank hands the engine on its own GPU a handle to its own copy.
    """
    if not everywhere and (layout.cp_rank != 0 or layout.dp_rank >= layout.ep):
        return
    dense = everywhere or layout.dp_rank == 0  # else the other ranks here only hold experts of the source's EP group
    tp = _Gather(parallel_state.get_tensor_model_parallel_group(), layout.tp, everywhere)
    ep = _Gather(parallel_state.get_expert_model_parallel_group(), layout.ep, everywhere) if layout.ep > 1 else None
    arch = converter.arch
    batch: list[tuple[str, torch.Tensor]] = []
    experts: list[tuple[str, torch.Tensor]] = []
    size = expert_size = 0
    for name, param in named_global_parameters(chunks):
        if arch.tied_embeddings and name == "output_layer.weight":
            continue
        local = tensor_of(param)
        if is_expert_parameter(name):
            if experts and (local.dtype != experts[-1][1].dtype or expert_size + _nbytes(local) > GATHER_BATCH_BYTES):
                yield from _expert_plans(experts, converter, layout, tp, ep)
                experts, expert_size = [], 0
            experts.append((name, local))
            expert_size += _nbytes(local)
            continue
        if not dense:
            continue
        if layout.tp == 1 or converter.split_of(name) is Split.REPLICATED:
            if layout.tp_rank == 0 or everywhere:
                yield from converter.plans(name, [local])
            continue
        if batch and (local.dtype != batch[-1][1].dtype or size + _nbytes(local) > GATHER_BATCH_BYTES):
            yield from _gathered_plans(batch, converter, tp)
            batch, size = [], 0
        batch.append((name, local))
        size += _nbytes(local)
    if batch:
        yield from _gathered_plans(batch, converter, tp)
    if experts:
        yield from _expert_plans(experts, converter, layout, tp, ep)


def export_hf(
    chunks: list[torch.nn.Module],
    converter: Converter,
    layout: Layout,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = _detach,
    everywhere: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_plans` as (HF name, tensor) pairs the caller may keep (collective in the same way)."""
    for name, plan in export_plans(chunks, converter, layout, tensor_of, everywhere):
        yield name, plan.materialize()


def _gathered_plans(
    batch: list[tuple[str, torch.Tensor]], converter: Converter, tp: _Gather
) -> Iterator[tuple[str, TensorPlan]]:
    """Gather a batch of TP-sharded parameters (one transfer per rank); the receiving ranks yield their plans."""
    shards = tp.shards([local for _, local in batch])
    if shards is not None:
        for i, (name, _) in enumerate(batch):
            yield from converter.plans(name, [mine[i] for mine in shards], transient=True)


def _expert_plans(
    batch: list[tuple[str, torch.Tensor]], converter: Converter, layout: Layout, tp: _Gather, ep: _Gather | None
) -> Iterator[tuple[str, TensorPlan]]:
    """Gather a batch of expert parameters over TP and the gathered buffer, as it is, over EP (every EP rank's
    TP shards); the source rank (with `everywhere`, every rank) yields their plans, expert indices shifted to
    each EP rank's experts."""
    locals_ = [local for _, local in batch]
    if ep is None:
        yield from _gathered_plans(batch, converter, tp) if layout.tp > 1 else _own_plans(batch, converter)
        return
    gathered = tp(tp.pack(locals_)) if layout.tp > 1 else tp.pack(locals_)
    if gathered is None:
        return
    gathered = ep(gathered)
    if gathered is None or (layout.dp_rank != 0 and not ep.everywhere):
        return
    per_rank = converter.arch.num_experts // layout.ep
    n = gathered.numel() // (layout.ep * layout.tp)  # one TP rank's batch; EP rank e's TP rank t at slot e*tp+t
    slots = [_views(gathered[i * n : (i + 1) * n], locals_) for i in range(layout.ep * layout.tp)]
    for ep_rank in range(layout.ep):
        # `name` holds this rank's expert index; EP rank r holds experts r * per_rank .. (r + 1) * per_rank - 1
        def renumber(e: int, r: int = ep_rank) -> int:
            return e + (r - layout.ep_rank) * per_rank

        held = slots[ep_rank * layout.tp : (ep_rank + 1) * layout.tp]
        for i, (name, _) in enumerate(batch):
            yield from converter.plans(with_expert(name, renumber), [s[i] for s in held], transient=True)


def _own_plans(batch: list[tuple[str, torch.Tensor]], converter: Converter) -> Iterator[tuple[str, TensorPlan]]:
    for name, local in batch:
        yield from converter.plans(name, [local])


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
