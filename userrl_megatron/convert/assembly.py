"""One HF tensor as pieces of tensor-parallel shards (pure torch): written straight into a destination, or built.

A `TensorPlan` is what the export hands out instead of a full tensor: the HF tensor's shape and dtype, and views
of the (gathered) shards that are its consecutive slices along one dimension. A fused QKV shard holds whole GQA
groups, a gate/up shard its gate and up halves, a vocabulary shard padded rows, so each HF tensor is the
concatenation of the same slice of every shard (`Converter.plans`). Weight sync `fill`s each plan straight into
its place in the flat bucket (one strided copy per piece, no full tensor in between); the HF export and callers
that keep tensors `materialize` them.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorPlan:
    """An HF tensor of `shape` made of `pieces`, its consecutive slices along `dim` (0, or 1 for row-parallel
    shards), each a view holding its slice's elements in row-major order (a QKV piece keeps a leading group
    dimension). `transient`: the pieces live in memory the export reuses for its next batch, so they must be
    consumed (filled or materialized) before the export is advanced."""

    shape: tuple[int, ...]
    pieces: tuple[torch.Tensor, ...]
    dim: int = 0
    transient: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorPlan":
        """A whole tensor as a plan of one piece."""
        return cls(tuple(tensor.shape), (tensor.detach(),))

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype

    @property
    def device(self) -> torch.device:
        return self.pieces[0].device

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.pieces[0].element_size()

    def fill(self, out: torch.Tensor) -> None:
        """Copy the tensor into `out` (contiguous, of `shape` and `dtype`): one copy per piece."""
        if len(self.pieces) == 1:
            out.view(self.pieces[0].shape).copy_(self.pieces[0])
            return
        row = math.prod(self.shape[1:])
        offset = 0
        for piece in self.pieces:
            extent = piece.shape[1] if self.dim == 1 else piece.numel() // row
            target = out.narrow(self.dim, offset, extent)
            (target if target.shape == piece.shape else target.view(piece.shape)).copy_(piece)
            offset += extent

    def materialize(self) -> torch.Tensor:
        """The tensor on its own: a view of a single contiguous piece in memory the export keeps, else a copy."""
        piece = self.pieces[0]
        if len(self.pieces) == 1 and piece.is_contiguous():
            whole = piece.view(self.shape)
            return whole.clone() if self.transient else whole
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.fill(out)
        return out


def cut_rows(pieces: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """The leading pieces (along dim 0) that hold the first `rows` rows: the vocabulary padding cut off."""
    kept: list[torch.Tensor] = []
    for piece in pieces:
        if rows <= 0:
            break
        kept.append(piece[:rows])
        rows -= piece.shape[0]
    return kept
