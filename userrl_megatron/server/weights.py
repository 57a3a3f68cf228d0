"""Receiving weights from trainer rank 0 over a custom process group, per SGLang's wire protocol.

load_format None: one `broadcast(src=0)` per tensor, in `names` order, each of exactly its dtype and shape.
load_format "flattened_bucket": one `broadcast(src=0)` of a flat uint8 buffer holding every tensor back to back.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from userrl_megatron.wire.bucket import FlatBuffer, bucket_layout, unpack_bucket

LOAD_FORMATS = (None, "flattened_bucket")
RECEIVE_ALIGN = 64  # byte alignment of each tensor of a per-tensor update in the receive buffer
Destination = Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor | None]  # (name, dtype, shape) -> memory


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
    device: torch.device,
    buffer: FlatBuffer | None = None,
    destination: Destination | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Block until the trainer's broadcasts arrive; returns (HF name, tensor) pairs in `names` order.

    The tensors land in `buffer` when given (reused across updates; per tensor, each in its own aligned slice);
    the tensors returned are views into it, valid until the next update. Per tensor, a tensor for which
    `destination` returns memory is broadcast straight into it (the engine's own parameter: nothing to copy on
    load) and left out of the result."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; the embedded server takes null or flattened_bucket")
    if load_format == "flattened_bucket":
        layout = bucket_layout(names, dtypes, shapes)
        flat = (buffer or FlatBuffer(device)).take(layout[-1].end)
        dist.broadcast(flat, src=0, group=group)
        return unpack_bucket(flat, layout)
    if not (names or dtypes or shapes):
        return []  # nothing broadcast (SGLang loads nothing); a bucket may not be empty
    entries = bucket_layout(names, dtypes, shapes, pad_to=RECEIVE_ALIGN)  # checks every entry before any lands
    places = [destination(e.name, e.dtype, e.shape) if destination else None for e in entries]
    # The rest land in their own aligned slices of the reused buffer: fresh allocations would cost page faults.
    rest = [e for e, place in zip(entries, places, strict=True) if place is None]
    received: list[tuple[str, torch.Tensor]] = []
    if rest:
        layout = bucket_layout([e.name for e in rest], [e.dtype for e in rest], [e.shape for e in rest], RECEIVE_ALIGN)
        received = unpack_bucket((buffer or FlatBuffer(device)).take(layout[-1].end), layout)
    slots = iter(received)
    targets = [place if place is not None else next(slots)[1] for place in places]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in targets]
    for handle in handles:
        handle.wait()
    return received
