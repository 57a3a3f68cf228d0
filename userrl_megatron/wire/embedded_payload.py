"""The embedded engine's payload format for `/update_weights_from_tensor`: a JSON header and raw bytes, so that
reading one executes nothing. The senders write it to engines of backend "embedded" (`EngineEndpoint.backend`);
SGLang gets its own pickle format (`sglang_payload.py`).

A payload (base64 in the JSON body, one per engine TP rank) is MAGIC, the header's length (4 bytes,
little-endian), the header (UTF-8 JSON), then the bytes of the inline buffers, back to back:

    {"buffers": [{"kind": "shm", "name": "/torch_<pid>_<n>_<n>", "nbytes": N}
                 | {"kind": "cuda", "nbytes": N, "device_uuid": "...", "handle": "<base64>", "offset": n,
                    "ref_counter": "/torch_...", "ref_counter_offset": k, "event_handle": "<base64>",
                    "event_sync_required": true}
                 | {"kind": "inline", "nbytes": N}],
     "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [576], "buffer": 0, "offset": 0}]}

A buffer is a whole storage: a shared-memory file of torch's naming (`handles.py`), a CUDA storage by the fields
of torch's IPC reduction with the device by UUID, or bytes in the payload. A tensor is contiguous, `offset` bytes
into its buffer (a multiple of its dtype's size, SGLang's alignment rule). The header places every tensor, so
`load_format` (null, "direct" or "flattened_bucket") changes nothing here.

The reader checks everything before it maps anything: the header's size, nesting depth and counts, every field's
type, each tensor inside its buffer, the buffers and the tensors each within `max_bytes` together, and the inline
bytes adding up to what follows the header; then a shared-memory file's owner and real size (`handles.open_shm`),
a CUDA device's UUID and reference-counter file. A flattened bucket travels as its segment's storage, each
tensor at its place in it.
"""

import base64
import binascii
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from userrl_megatron.wire.handles import (
    CUDA_IPC_REF_COUNTERS,
    SHM_HANDLE,
    Segments,
    check_ref_counter,
    device_index,
    device_uuid,
    open_shm,
)

MAGIC = b"USERRLW1"
MAX_HEADER_BYTES = 16 << 20
MAX_DEPTH = 4  # the header's nesting: {"tensors": [{"shape": [...]}]}
MAX_TENSORS = 1 << 16
MAX_BUFFERS = 1 << 16
MAX_DIMS = 8
MAX_NAME_CHARS = 1024
MAX_HANDLE_BYTES = 4096  # a CUDA IPC or event handle (64 bytes from torch)
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    )
}
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_KINDS = {int: "an integer", str: "a string", list: "a list", bool: "true or false"}


@dataclass(frozen=True)
class CudaHandle:
    """What torch's CUDA IPC reduction carries for one storage, the device by UUID."""

    device_uuid: str
    handle: bytes
    offset: int  # of the storage in the allocation the handle names
    ref_counter: bytes  # torch's reference-counter file and the counter in it
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class Buffer:
    kind: str  # "shm", "cuda" or "inline"
    nbytes: int
    name: bytes = b""  # shm: torch's file name
    cuda: CudaHandle | None = None
    start: int = 0  # inline: where its bytes start in the payload


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: int
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    buffers: list[Buffer]
    tensors: list[Entry]


# ---- writing (the trainer) ----


def write_payload(named: Sequence[tuple[str, torch.Tensor]], inline: bool = False) -> str:
    """The base64 payload of `named`: each tensor (contiguous) placed in its storage, each storage a handle (a
    shared-memory file on CPU, moved there if it is not yet, or CUDA IPC) or, with `inline`, its bytes in the
    payload. The sender keeps the storages alive until the engine answered."""
    buffers: list[dict[str, Any]] = []
    places: dict[tuple[str, int], int] = {}  # (device, storage address) -> buffer index
    inline_bytes: list[bytes] = []
    tensors = []
    for name, tensor in named:
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES or not tensor.is_contiguous():
            raise ValueError(f"{name}: a payload carries contiguous tensors of {', '.join(DTYPES)}, not {tensor.dtype}")
        if inline:
            index, offset = len(buffers), 0
            data = tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            buffers.append({"kind": "inline", "nbytes": len(data)})
            inline_bytes.append(data)
        else:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in places:
                places[key] = len(buffers)
                buffers.append(_handle(storage, tensor.device))
            index, offset = places[key], int(tensor.storage_offset()) * tensor.element_size()
        tensors.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "buffer": index,
                "offset": offset,
            }
        )
    header = json.dumps({"buffers": buffers, "tensors": tensors}, separators=(",", ":")).encode()
    data = MAGIC + len(header).to_bytes(4, "little") + header + b"".join(inline_bytes)
    return base64.b64encode(data).decode()


def _handle(storage: torch.UntypedStorage, device: torch.device) -> dict[str, Any]:
    """The buffer naming `storage`: its shared-memory file on CPU, its CUDA IPC handle on a GPU."""
    if device.type == "cpu":
        _, name, _ = storage._share_filename_cpu_()
        return {"kind": "shm", "name": name.decode(), "nbytes": storage.nbytes()}
    if device.type != "cuda":
        raise ValueError(f"a {device.type} tensor cannot travel as a handle")
    index, handle, nbytes, offset, ref_counter, ref_offset, event, event_sync = share_cuda(storage)
    return {
        "kind": "cuda",
        "nbytes": nbytes,
        "device_uuid": device_uuid(index),
        "handle": base64.b64encode(handle).decode(),
        "offset": offset,
        "ref_counter": ref_counter.decode(),
        "ref_counter_offset": ref_offset,
        "event_handle": base64.b64encode(event or b"").decode(),
        "event_sync_required": bool(event_sync),
    }


def share_cuda(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """torch's CUDA IPC fields of `storage`: (device index, handle, size, offset in its allocation, reference-
    counter file, counter offset, event handle, event sync required)."""
    return tuple(storage._share_cuda_())


# ---- reading (the embedded engine) ----


class PayloadError(ValueError):
    """A payload the reader refuses, and why."""


def parse_header(data: bytes, max_bytes: int) -> Header:
    """The checked header of payload `data` (MAGIC first): nothing is mapped or allocated for its tensors."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise PayloadError(f"a payload starts with {MAGIC.decode()} and its header's length")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    body = len(MAGIC) + 4 + size
    if size > MAX_HEADER_BYTES or body > len(data):
        raise PayloadError(f"a payload header of {size} bytes (at most {MAX_HEADER_BYTES}, within the payload)")
    text = data[len(MAGIC) + 4 : body]
    if _depth(text) > MAX_DEPTH:
        raise PayloadError(f"the payload header nests deeper than {MAX_DEPTH} levels")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"the payload header is not JSON: {e}") from None
    _fields(header, "the payload header", {"buffers": list, "tensors": list})
    if len(header["buffers"]) > MAX_BUFFERS or len(header["tensors"]) > MAX_TENSORS:
        raise PayloadError(f"a payload holds at most {MAX_BUFFERS} buffers and {MAX_TENSORS} tensors")
    buffers, total, start = [], 0, body
    for i, raw in enumerate(header["buffers"]):
        buffer = _buffer(raw, f"buffer {i}", start)
        total += buffer.nbytes
        if total > max_bytes:
            raise PayloadError(f"the payload's buffers exceed {max_bytes} bytes")
        start += buffer.nbytes if buffer.kind == "inline" else 0
        buffers.append(buffer)
    if start != len(data):
        raise PayloadError(f"the inline buffers hold {start - body} bytes; {len(data) - body} follow the header")
    names = [b.name for b in buffers if b.kind == "shm"]
    if len(set(names)) != len(names):
        raise PayloadError("a shared-memory file is named by two buffers")
    tensors, total = [], 0
    for raw in header["tensors"]:
        entry = _entry(raw, buffers)
        total += entry.nbytes
        if total > max_bytes:
            raise PayloadError(f"the payload's tensors exceed {max_bytes} bytes")
        tensors.append(entry)
    return Header(buffers, tensors)


def read_payload(data: bytes, max_bytes: int, segments: Segments | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one rank's payload (raw bytes), each a view of its buffer: shared memory mapped
    (or kept mapped in `segments`), CUDA memory opened, inline bytes copied."""
    header = parse_header(data, max_bytes)
    opened = [_open(buffer, data, segments) for buffer in header.buffers]
    return [
        (e.name, opened[e.buffer][e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)) for e in header.tensors
    ]


def _open(buffer: Buffer, data: bytes, segments: Segments | None) -> torch.Tensor:
    """A buffer's bytes as a uint8 tensor."""
    if buffer.kind == "inline":
        return (
            torch.frombuffer(
                bytearray(memoryview(data)[buffer.start : buffer.start + buffer.nbytes]), dtype=torch.uint8
            )
            if buffer.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
    if buffer.kind == "shm":
        return (
            segments.map(buffer.name, buffer.nbytes)
            if segments is not None
            else open_shm(buffer.name, buffer.nbytes)[0]
        )
    return open_cuda(buffer)


def open_cuda(buffer: Buffer) -> torch.Tensor:
    """The CUDA storage `buffer` names, opened through torch's IPC rebuild on the device with its UUID, as uint8."""
    assert buffer.cuda is not None
    h = buffer.cuda
    index = device_index(h.device_uuid)
    if buffer.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    check_ref_counter(h.ref_counter, h.ref_counter_offset)
    return reductions.rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([buffer.nbytes]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        index,
        h.handle,
        buffer.nbytes,
        h.offset,
        False,
        h.ref_counter,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


def _depth(text: bytes) -> int:
    """How deep JSON `text` nests (strings left out), counted without parsing it."""
    depth = deepest = 0
    for bracket in re.finditer(rb"[\[\]{}]", _STRING.sub(b"", text)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def _fields(raw: Any, what: str, types: dict[str, type]) -> None:
    """`raw` is an object with exactly the keys of `types`, each of its type (`int`: not a bool)."""
    if type(raw) is not dict or set(raw) != set(types):
        raise PayloadError(f"{what} has the fields {', '.join(types)}")
    for key, kind in types.items():
        if type(raw[key]) is not kind:
            raise PayloadError(f"{what}: {key} is {_KINDS[kind]}")


def _count(value: int, what: str, limit: int | None = None) -> int:
    if value < 0 or (limit is not None and value >= limit):
        raise PayloadError(f"{what} is out of range: {value}")
    return value


def _handle_bytes(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError(f"{what} is base64") from None
    if len(raw) > MAX_HANDLE_BYTES:
        raise PayloadError(f"{what} holds at most {MAX_HANDLE_BYTES} bytes")
    return raw


def _shm_name(text: str, what: str) -> bytes:
    name = text.encode()
    if not SHM_HANDLE.fullmatch(name):
        raise PayloadError(f"{what} is not a torch shared-memory file name: {text[:80]!r}")
    return name


def _buffer(raw: Any, what: str, start: int) -> Buffer:
    kind = raw.get("kind") if type(raw) is dict else None
    if kind == "inline":
        _fields(raw, what, {"kind": str, "nbytes": int})
        return Buffer("inline", _count(raw["nbytes"], f"{what}'s size"), start=start)
    if kind == "shm":
        _fields(raw, what, {"kind": str, "name": str, "nbytes": int})
        return Buffer("shm", _count(raw["nbytes"], f"{what}'s size"), name=_shm_name(raw["name"], what))
    if kind == "cuda":
        _fields(
            raw,
            what,
            {
                "kind": str,
                "nbytes": int,
                "device_uuid": str,
                "handle": str,
                "offset": int,
                "ref_counter": str,
                "ref_counter_offset": int,
                "event_handle": str,
                "event_sync_required": bool,
            },
        )
        if len(raw["device_uuid"]) > 128:
            raise PayloadError(f"{what}: device_uuid is a device's UUID")
        handle = CudaHandle(
            raw["device_uuid"],
            _handle_bytes(raw["handle"], f"{what}'s handle"),
            _count(raw["offset"], f"{what}'s offset"),
            _shm_name(raw["ref_counter"], f"{what}'s ref_counter"),
            _count(raw["ref_counter_offset"], f"{what}'s ref_counter_offset", CUDA_IPC_REF_COUNTERS),
            _handle_bytes(raw["event_handle"], f"{what}'s event_handle"),
            raw["event_sync_required"],
        )
        return Buffer("cuda", _count(raw["nbytes"], f"{what}'s size"), cuda=handle)
    raise PayloadError(f"{what} is of kind shm, cuda or inline")


def _entry(raw: Any, buffers: list[Buffer]) -> Entry:
    _fields(raw, "a tensor", {"name": str, "dtype": str, "shape": list, "buffer": int, "offset": int})
    name, shape = raw["name"], raw["shape"]
    what = f"tensor {name[:80]!r}"
    if not 0 < len(name) <= MAX_NAME_CHARS:
        raise PayloadError(f"a tensor's name has 1 to {MAX_NAME_CHARS} characters")
    dtype = DTYPES.get(raw["dtype"])
    if dtype is None:
        raise PayloadError(f"{what}: dtype {raw['dtype'][:40]!r} is not one of {', '.join(DTYPES)}")
    if len(shape) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape):
        raise PayloadError(f"{what}: a shape is at most {MAX_DIMS} non-negative integers")
    index = _count(raw["buffer"], f"{what}'s buffer", len(buffers))
    entry = Entry(name, dtype, tuple(shape), index, _count(raw["offset"], f"{what}'s offset"))
    if entry.offset % dtype.itemsize:
        raise PayloadError(f"{what}: offset {entry.offset} is not a multiple of its dtype's {dtype.itemsize} bytes")
    if entry.offset + entry.nbytes > buffers[index].nbytes:
        raise PayloadError(
            f"{what} of {entry.nbytes} bytes at offset {entry.offset} does not fit its buffer of "
            f"{buffers[index].nbytes} bytes"
        )
    return entry
