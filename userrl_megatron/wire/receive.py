"""What the embedded engine reads from `/update_weights_from_tensor`: its own rank's payload, in its own format
(`embedded_payload.py`), or in SGLang's pickle format (`sglang_payload.py`) only when the server was started with
`--accept-pickle-payloads`; anything else is refused before it is read."""

import base64
from collections.abc import Sequence

import torch

from userrl_megatron.wire.embedded_payload import MAGIC, read_payload
from userrl_megatron.wire.handles import Segments
from userrl_megatron.wire.sglang_payload import DEFAULT_MAX_BYTES, read_pickle

LOAD_FORMATS = (None, "direct", "flattened_bucket")
PICKLES_OFF = (
    "the payload is a pickle (SGLang's format), which this server reads only when started with "
    "--accept-pickle-payloads; weight senders write its own format to engines of backend 'embedded'"
)


def decode_payload(
    payloads: Sequence[str | bytes],
    load_format: str | None,
    rank: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    segments: Segments | None = None,
    accept_pickle: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """TP rank `rank`'s (name, tensor) pairs of an `/update_weights_from_tensor` request (entries of other ranks
    are not read: reading one maps its memory); its buffers and its tensors hold at most `max_bytes` each, and
    shared memory its sender keeps stays mapped in `segments`. A payload is base64 text, or its raw bytes."""
    if load_format not in LOAD_FORMATS:
        raise NotImplementedError(f"Unknown load_format={load_format}")
    if rank >= len(payloads):
        raise IndexError(f"no payload for TP rank {rank} ({len(payloads)} given)")
    payload = payloads[rank]
    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    if data.startswith(MAGIC):
        return read_payload(data, max_bytes, segments)
    if data[:1] == b"\x80":
        if not accept_pickle:
            raise ValueError(PICKLES_OFF)
        return read_pickle(data, load_format, max_bytes)
    raise ValueError(f"a payload starts with {MAGIC.decode()} (this server's format) or is a pickle")
