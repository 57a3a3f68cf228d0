"""Receiving weights from trainer rank 0 over a custom process group, per SGLang's wire protocol.

load_format None: one `broadcast(src=0)` per tensor, in `names` order, each of exactly its dtype and shape.
load_format "flattened_bucket": one `broadcast(src=0)` of a flat uint8 buffer holding every tensor back to back.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from userrl_megatron.sync.bucket import FlatBuffer, bucket_layout, dtype_from_name, unpack_bucket

LOAD_FORMATS = (None, "flattened_bucket")


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
    device: torch.device,
    buffer: FlatBuffer | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Block until the trainer's broadcasts arrive; returns (HF name, tensor) pairs in `names` order.

    A flattened bucket lands in `buffer` when given (reused across updates); the tensors returned are views
    into it, valid until the next update."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; the embedded server takes null or flattened_bucket")
    if load_format == "flattened_bucket":
        layout = bucket_layout(names, dtypes, shapes)
        flat = (buffer or FlatBuffer(device)).take(layout[-1].end)
        dist.broadcast(flat, src=0, group=group)
        return unpack_bucket(flat, layout)
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    received, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(list(shape), dtype=dtype_from_name(dtype), device=device)
        handles.append(dist.broadcast(tensor, src=0, group=group, async_op=True))
        received.append((name, tensor))
    for handle in handles:
        handle.wait()
    return received
