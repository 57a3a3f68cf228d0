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
    names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[BucketEntry]:
    """Byte ranges of every tensor, checking SGLang's alignment rule."""
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
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        nbytes = size.numel() * dtype.itemsize
        entries.append(BucketEntry(name, dtype, tuple(size), offset, offset + nbytes))
        offset += nbytes
    return entries


def pack_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[BucketEntry]]:
    """One flat uint8 buffer holding every tensor's raw bytes, and the layout the receiver will compute."""
    layout = bucket_layout(
        [name for name, _ in named_tensors],
        [t.dtype for _, t in named_tensors],
        [t.shape for _, t in named_tensors],
    )
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named_tensors])
    return flat, layout


def unpack_bucket(flat: torch.Tensor, layout: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors inside `flat` (no copy)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a bucket is a 1-D uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    if layout and flat.numel() != layout[-1].end:
        raise ValueError(f"bucket holds {flat.numel()} bytes but the layout needs {layout[-1].end}")
    return [(e.name, flat[e.start : e.end].view(e.dtype).reshape(e.shape)) for e in layout]
