"""SGLang's `flattened_bucket` layout: named tensors packed back to back into one flat uint8 buffer.

Tensors sit in `names` order with no padding; each tensor's byte offset must be a multiple of its dtype's size
(SGLang 0.5.23 rejects an unaligned layout; order mixed-dtype buckets so that larger itemsizes come first, or
keep one dtype per bucket). The receiver rebuilds the tensors from (names, dtypes, shapes) alone.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lives in the flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset
    end: int  # one past the last byte


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` -> torch.bfloat16 (the wire names SGLang uses: torch attribute names without `torch.`)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def bucket_layout(
    names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]], pad_to: int = 0
) -> list[BucketEntry]:
    """Byte ranges of every tensor, checking SGLang's alignment rule; with `pad_to`, each tensor starts at the
    next multiple of `pad_to` instead (a receive buffer of our own, not a wire layout)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if not names:
        raise ValueError("Cannot create empty tensor bucket")
    entries, offset = [], 0
    for name, dtype_spec, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype_from_name(dtype_spec)
        size = torch.Size(shape)
        if any(dim < 0 for dim in size):
            raise ValueError(f"Negative dimension in received tensor {name}: {size}")
        if pad_to:
            offset = -(-offset // pad_to) * pad_to
        elif offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        nbytes = size.numel() * dtype.itemsize
        entries.append(BucketEntry(name, dtype, tuple(size), offset, offset + nbytes))
        offset += nbytes
    return entries


class FlatBuffer:
    """A flat uint8 buffer kept across weight pushes, grown when a bucket needs more room.

    A fresh multi-hundred-megabyte allocation per bucket costs more in page faults than the copy or the
    broadcast itself on CPU; reusing one buffer pays that once. Views into it are valid until the next `take`.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._data = torch.empty(0, dtype=torch.uint8, device=self.device)

    def take(self, nbytes: int) -> torch.Tensor:
        """A view of the first `nbytes` bytes (contents undefined)."""
        if self._data.numel() < nbytes:
            self._data = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            self._data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._data[:nbytes]


def pack_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], buffer: FlatBuffer | None = None
) -> tuple[torch.Tensor, list[BucketEntry]]:
    """One flat uint8 buffer holding every tensor's raw bytes (in `buffer` when given), and its layout."""
    layout = bucket_layout(
        [name for name, _ in named_tensors],
        [t.dtype for _, t in named_tensors],
        [t.shape for _, t in named_tensors],
    )
    flat = (buffer or FlatBuffer(named_tensors[0][1].device)).take(layout[-1].end)
    for entry, (_, tensor) in zip(layout, named_tensors, strict=True):
        flat[entry.start : entry.end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, layout


def unpack_bucket(flat: torch.Tensor, layout: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors inside `flat` (no copy)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a bucket is a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    if layout and flat.numel() != layout[-1].end:
        raise ValueError(f"bucket holds {flat.numel()} bytes but the layout needs {layout[-1].end}")
    return [(e.name, flat[e.start : e.end].view(e.dtype).reshape(e.shape)) for e in layout]
