"""Full HF-named tensors from a sharded Megatron model: weight sync and HF export walk the same code.

`export_hf` walks this rank's pipeline stage (all its virtual chunks), gathers the tensor-parallel
parameters' shards onto tp_rank 0 of the stage (in flat batches, one collective each), rebuilds each full
tensor (`convert.sharding.unshard`: fused gate/up re-ordered, vocabulary padding cut) and converts it with
the family's rules. Only the stage's source rank (tp_rank 0, dp_rank 0, cp_rank 0) yields; the other ranks
of its TP group take part in the gathers and yield nothing; ranks of other data-parallel replicas return at
once.
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import parallel_state

from userrl_megatron.convert.rules import Converter, Split
from userrl_megatron.convert.sharding import unshard
from userrl_megatron.megatron.model import named_global_parameters
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
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of `tensor_of(param)` for every parameter of the (unwrapped) chunks.

    Collective inside the stage's TP group: every rank must exhaust the iterator. A tied LM head is skipped.
    """
    if layout.dp_rank != 0 or layout.cp_rank != 0:
        return
    tp_group = parallel_state.get_tensor_model_parallel_group()
    root = torch.distributed.get_global_rank(tp_group, 0)
    arch = converter.arch
    batch: list[tuple[str, Split, torch.Tensor]] = []
    size = 0
    for name, param in named_global_parameters(chunks):
        if arch.tied_embeddings and name == "output_layer.weight":
            continue
        split = converter.split_of(name)
        local = tensor_of(param)
        if layout.tp == 1 or split is Split.REPLICATED:
            if layout.tp_rank == 0:
                yield from converter.to_hf(name, unshard([local], split, rows=arch.vocab_size))
            continue
        if batch and (local.dtype != batch[-1][2].dtype or size + _nbytes(local) > GATHER_BATCH_BYTES):
            yield from _gathered(batch, converter, layout, tp_group, root)
            batch, size = [], 0
        batch.append((name, split, local))
        size += _nbytes(local)
    if batch:
        yield from _gathered(batch, converter, layout, tp_group, root)


def _gathered(
    batch: list[tuple[str, Split, torch.Tensor]], converter: Converter, layout: Layout, group: Any, root: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather a batch of TP-sharded parameters with one collective; tp_rank 0 yields their HF tensors.

    Every rank of the group holds shards of the same shapes, so one flat buffer per rank lines them up."""
    flat = torch.cat([local.reshape(-1) for _, _, local in batch])
    buffers = [torch.empty_like(flat) for _ in range(layout.tp)] if layout.tp_rank == 0 else None
    torch.distributed.gather(flat, buffers, dst=root, group=group)
    if buffers is None:
        return
    offset = 0
    for name, split, local in batch:
        n = local.numel()
        shards = [buffer[offset : offset + n].view(local.shape) for buffer in buffers]
        offset += n
        yield from converter.to_hf(name, unshard(shards, split, rows=converter.arch.vocab_size))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def gather_hf_state_dict(
    chunks: list[torch.nn.Module], converter: Converter, layout: Layout
) -> dict[str, torch.Tensor] | None:
    """The whole HF state dict (CPU tensors) on global rank 0, None on every other rank. Collective."""
    local = {name: tensor.cpu() for name, tensor in export_hf(chunks, converter, layout)}
    if not layout.is_stage_source:
        return None
    if layout.pp == 1:
        return local
    # Global rank 0's pipeline group is exactly the source ranks of every stage.
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    stages: list[dict[str, torch.Tensor]] | None = [{} for _ in range(layout.pp)] if layout.pp_rank == 0 else None
    torch.distributed.gather_object(local, stages, dst=torch.distributed.get_global_rank(pp_group, 0), group=pp_group)
    if stages is None:
        return None
    return {name: tensor for stage in stages for name, tensor in stage.items()}
