"""Tensor-parallel shards of full Megatron tensors, and back (pure torch).

`shard` gives rank r's slice of a full tensor, as Megatron lays it out; `unshard` rebuilds the full tensor
from all ranks' slices (in rank order). Vocabulary tensors are zero-padded to Megatron's padded vocab size
before slicing, and the padding is cut off again when they are rebuilt.
"""

from collections.abc import Sequence

import torch

from userrl_megatron.convert.rules import Split


def shard(full: torch.Tensor, split: Split, rank: int, size: int, padded_rows: int | None = None) -> torch.Tensor:
    """Rank `rank`'s shard (of `size`) of `full`. VOCAB needs `padded_rows`, the padded vocabulary size."""
    if split is Split.REPLICATED or (size == 1 and split is not Split.VOCAB):
        return full
    if split is Split.VOCAB:
        if padded_rows is None or padded_rows < full.shape[0] or padded_rows % size:
            raise ValueError(f"padded vocab {padded_rows} must be >= {full.shape[0]} and divisible by TP {size}")
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])], dim=0)
        return torch.chunk(full, size, dim=0)[rank]
    dim = 1 if split is Split.ROW else 0
    if full.shape[dim] % size:
        raise ValueError(f"a {split.value} tensor of shape {tuple(full.shape)} does not split over TP {size}")
    if split is Split.GATED_COLUMN:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, dim=0)[rank], torch.chunk(up, size, dim=0)[rank]], dim=0)
    return torch.chunk(full, size, dim=dim)[rank]


def unshard(shards: Sequence[torch.Tensor], split: Split, rows: int | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard. VOCAB keeps the first `rows` rows (the real vocabulary)."""
    if split is Split.REPLICATED or (len(shards) == 1 and split is not Split.VOCAB):
        return shards[0]
    if split is Split.VOCAB:
        full = torch.cat(list(shards), dim=0)
        return full[:rows] if rows is not None else full
    if split is Split.ROW:
        return torch.cat(list(shards), dim=1)
    if split is Split.GATED_COLUMN:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0)
