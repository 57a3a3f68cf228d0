"""The embedded engine's payload format (`wire/embedded_payload.py`): a JSON header and raw bytes. Every bound is
checked before anything is mapped: the header's size, depth and counts, each field's type, each tensor inside its
buffer, the buffers and tensors within the engine's bound, the inline bytes, a shared-memory file's name, owner
and real size (never grown). The CUDA branch runs on the CPU here: torch's IPC calls are replaced by fakes, and
what the format carries (the fields of torch's reduction, the device by UUID, the reference-counter file) is
checked; the senders pick the format by the engine's backend (`EngineEndpoint.backend`)."""

import base64
import json
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from tests.support.fake_cuda import FakeCuda
from tests.support.payloads import packed
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.sender import EngineEndpoint
from userrl_megatron.sync.tensor_sender import TensorSender
from userrl_megatron.wire import embedded_payload, handles
from userrl_megatron.wire.embedded_payload import MAGIC, PayloadError, parse_header, read_payload, write_payload
from userrl_megatron.wire.receive import decode_payload

LIMIT = 1 << 20


def raw(header: Any, tail: bytes = b"") -> bytes:
    """A payload of this JSON header (any value, or text as it is) and the bytes after it."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return MAGIC + len(text).to_bytes(4, "little") + text + tail


def tensor(name: str = "w", dtype: str = "float32", shape: Any = (2,), buffer: Any = 0, offset: Any = 0) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "buffer": buffer, "offset": offset}


def inline(*tensors: dict, nbytes: int = 8) -> bytes:
    return raw({"buffers": [{"kind": "inline", "nbytes": nbytes}], "tensors": list(tensors)}, bytes(nbytes))


@pytest.fixture
def shm_file() -> Iterator[Path]:
    """A file named as torch names shared memory, of torch's header and 16 bytes 0..15 (removed after the test)."""
    path = Path(f"/dev/shm/torch_{os.getpid()}_4242_{id(object())}")
    path.write_bytes(bytes(handles.SHM_HEADER_BYTES) + bytes(range(16)))
    yield path
    path.unlink(missing_ok=True)


def test_a_bucket_round_trips_through_its_segment_and_inline_bytes() -> None:
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(2).bfloat16()), ("c", torch.tensor(7, dtype=torch.int64))]
    packer = packed(named[:1])
    try:
        flat = packer.flat()
        view = flat[:60].view(torch.float32).view(3, 5)
        header = parse_header(base64.b64decode(write_payload([("a", view)])), LIMIT << 1)
        assert [(b.kind, b.nbytes, b.name.startswith(b"/torch_")) for b in header.buffers] == [("shm", 1 << 20, True)]
        [(name, got)] = decode_payload([write_payload([("a", view)])], "flattened_bucket", max_bytes=LIMIT << 1)
        assert name == "a" and torch.equal(got, named[0][1])
    finally:
        packer.buffer.release()
    back = decode_payload([write_payload(named, inline=True)], None)
    assert [(n, t.dtype, t.shape) for n, t in back] == [(n, t.dtype, t.shape) for n, t in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named, strict=True))


def test_the_sender_refuses_what_the_format_cannot_carry() -> None:
    with pytest.raises(ValueError, match=r"contiguous tensors of float64, .*, not torch\.complex64"):
        write_payload([("w", torch.ones(2, dtype=torch.complex64))], inline=True)
    with pytest.raises(ValueError, match="w: a payload carries contiguous tensors"):
        write_payload([("w", torch.ones(3, 2).t())], inline=True)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\x80\x04N.", "a payload starts with USERRLW1"),
        (MAGIC + (100).to_bytes(4, "little") + b"{}", "a payload header of 100 bytes"),
        (raw(b'{"buffers": [], "tensors": [{"shape": [[1]]}]}'), "the payload header nests deeper than 4 levels"),
        (raw(b"[" * 100_000 + b"]" * 100_000), "the payload header nests deeper than 4 levels"),
        (raw(b'{"buffers": [], "tensors": [{"name": "[[[[[["}]}'), "a tensor has the fields name, dtype"),  # text
        (raw(b'{"buffers": [], "tensors": ['), "the payload header is not JSON"),
        (raw({"buffers": [], "tensors": [], "code": "x"}), "the payload header has the fields buffers, tensors"),
        (raw({"buffers": {}, "tensors": []}), "the payload header: buffers is a list"),
        (raw({"buffers": [{"kind": "file", "nbytes": 1}], "tensors": []}), "buffer 0 is of kind shm, cuda or inline"),
        (raw({"buffers": [{"kind": "inline", "nbytes": True}], "tensors": []}), "buffer 0: nbytes is an integer"),
        (raw({"buffers": [{"kind": "inline", "nbytes": -1}], "tensors": []}), "buffer 0's size is out of range: -1"),
        (inline(nbytes=8)[:-1], "the inline buffers hold 8 bytes; 7 follow the header"),
        (inline(nbytes=8) + b"x", "the inline buffers hold 8 bytes; 9 follow the header"),
        (
            raw({"buffers": [{"kind": "inline", "nbytes": LIMIT + 1}], "tensors": []}, bytes(LIMIT + 1)),
            f"the payload's buffers exceed {LIMIT} bytes",
        ),
        (
            raw({"buffers": [{"kind": "shm", "name": "/torch_1_2_3", "nbytes": LIMIT + 1}], "tensors": []}),
            f"the payload's buffers exceed {LIMIT} bytes",
        ),
        (
            raw({"buffers": [{"kind": "shm", "name": "/etc/passwd", "nbytes": 8}], "tensors": []}),
            "buffer 0 is not a torch shared-memory file name: '/etc/passwd'",
        ),
        (
            raw({"buffers": [{"kind": "shm", "name": "/torch_1_2_3", "nbytes": 8}] * 2, "tensors": []}),
            "a shared-memory file is named by two buffers",
        ),
        (inline(tensor(dtype="complex64")), "tensor 'w': dtype 'complex64' is not one of float64"),
        (inline(tensor(dtype="bool")), "tensor 'w': dtype 'bool' is not one of"),
        (inline(tensor(name="")), "a tensor's name has 1 to 1024 characters"),
        (inline(tensor(shape=[1] * 9)), "tensor 'w': a shape is at most 8 non-negative integers"),
        (inline(tensor(shape=[-1])), "tensor 'w': a shape is at most 8 non-negative integers"),
        (inline(tensor(shape=[2.0])), "tensor 'w': a shape is at most 8 non-negative integers"),
        (inline(tensor(buffer=1)), "tensor 'w''s buffer is out of range: 1"),
        (inline(tensor(offset=2, shape=[1])), "tensor 'w': offset 2 is not a multiple of its dtype's 4 bytes"),
        (inline(tensor(shape=[3])), "tensor 'w' of 12 bytes at offset 0 does not fit its buffer of 8 bytes"),
        (inline(tensor(shape=[1 << 40, 1 << 40])), "does not fit its buffer of 8 bytes"),  # no overflow
        (inline(tensor(offset=8, shape=[1])), "tensor 'w' of 4 bytes at offset 8 does not fit its buffer of 8 bytes"),
        (
            raw({"buffers": [{"kind": "inline", "nbytes": 8}], "tensors": [tensor()] * 3}, bytes(8)),
            "the payload's tensors exceed 20 bytes",
        ),  # a bound of 20 below
    ],
)
def test_a_bad_header_is_refused_before_anything_is_mapped(
    payload: bytes, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handles, "open_shm", lambda *a: pytest.fail("mapped before the header was checked"))
    monkeypatch.setattr(embedded_payload, "open_shm", lambda *a: pytest.fail("mapped before the header was checked"))
    limit = 20 if "exceed 20" in message else LIMIT
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_payload(payload, limit)


def test_counts_and_the_header_size_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_payload, "MAX_TENSORS", 2)
    with pytest.raises(PayloadError, match="a payload holds at most 65536 buffers and 2 tensors"):
        read_payload(inline(tensor(), tensor(), tensor()), LIMIT)
    monkeypatch.setattr(embedded_payload, "MAX_HEADER_BYTES", 64)
    with pytest.raises(PayloadError, match=r"a payload header of \d+ bytes \(at most 64, within the payload\)"):
        read_payload(inline(tensor(), tensor()), LIMIT)


def test_a_shared_memory_file_is_checked_then_mapped_read_only(shm_file: Path) -> None:
    name = f"/{shm_file.name}"
    header = {"buffers": [{"kind": "shm", "name": name, "nbytes": 16}], "tensors": [tensor("w", "int32", [2], 0, 8)]}
    [(_, got)] = read_payload(raw(header), LIMIT)
    assert got.tolist() == [int.from_bytes(bytes(range(i, i + 4)), "little") for i in (8, 12)]
    # Naming more bytes than the file holds: refused, and the file is not grown (torch's own mapping would).
    header["buffers"][0]["nbytes"] = 1 << 20
    with pytest.raises(ValueError, match=f"the shared-memory file {name} holds 16 bytes, not the 1048576"):
        read_payload(raw(header), LIMIT)
    assert shm_file.stat().st_size == handles.SHM_HEADER_BYTES + 16
    shm_file.unlink()
    with pytest.raises(ValueError, match=f"no shared-memory file {name}"):
        read_payload(raw(header), LIMIT)
    shm_file.symlink_to("/etc/passwd")
    header["buffers"][0]["nbytes"] = 16
    with pytest.raises(ValueError, match=f"cannot open the shared-memory file {name}: Too many levels of symbolic"):
        read_payload(raw(header), LIMIT)


# ---- the CUDA branch, with fakes ----

FIELDS = (1, b"\x11" * 64, 4096, 512, b"/torch_77_1_2", 3, b"\x22" * 64, True)  # what torch's _share_cuda_ gives
UUIDS = ["GPU-aaaa", "GPU-bbbb"]  # the devices this process sees, by index


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(UUIDS))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=UUIDS[i]))


def test_a_cuda_bucket_travels_as_torchs_ipc_fields_with_the_device_by_uuid(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared: list[torch.UntypedStorage] = []
    monkeypatch.setattr(embedded_payload, "share_cuda", lambda storage: shared.append(storage) or FIELDS)
    with FakeCuda():
        flat = torch.zeros(1024, dtype=torch.uint8, device="cuda")
        named = [("a", flat[0:24].view(torch.float32).view(2, 3)), ("b", flat[64:72].view(torch.bfloat16))]
        payload = base64.b64decode(write_payload(named))
    assert len(shared) == 1  # one storage, one handle for both tensors
    header = json.loads(payload[len(MAGIC) + 4 :])
    assert header == {
        "buffers": [
            {
                "kind": "cuda",
                "nbytes": 4096,
                "device_uuid": "GPU-bbbb",  # index 1 on the sender's side, named by UUID
                "handle": base64.b64encode(FIELDS[1]).decode(),
                "offset": 512,
                "ref_counter": "/torch_77_1_2",
                "ref_counter_offset": 3,
                "event_handle": base64.b64encode(FIELDS[6]).decode(),
                "event_sync_required": True,
            }
        ],
        "tensors": [tensor("a", "float32", [2, 3], 0, 0), tensor("b", "bfloat16", [4], 0, 64)],
    }


@pytest.fixture
def ref_counter() -> Iterator[str]:
    """A reference-counter file as torch makes one (its header and 10000 int64 counters)."""
    path = Path(f"/dev/shm/torch_{os.getpid()}_99_{id(object())}")
    path.write_bytes(bytes(handles.SHM_HEADER_BYTES + 8 * handles.CUDA_IPC_REF_COUNTERS))
    yield f"/{path.name}"
    path.unlink(missing_ok=True)


def cuda_header(ref_counter: str, uuid: str = "GPU-bbbb", ref_offset: int = 3, nbytes: int = 4096) -> dict:
    buffer = {
        "kind": "cuda",
        "nbytes": nbytes,
        "device_uuid": uuid,
        "handle": base64.b64encode(FIELDS[1]).decode(),
        "offset": 512,
        "ref_counter": ref_counter,
        "ref_counter_offset": ref_offset,
        "event_handle": base64.b64encode(FIELDS[6]).decode(),
        "event_sync_required": True,
    }
    return {"buffers": [buffer], "tensors": [tensor("a", "float32", [2, 3], 0, 0), tensor("b", "bfloat16", [4], 0, 64)]}


def test_the_engine_opens_a_cuda_buffer_on_the_device_with_its_uuid(
    two_gpus: None, ref_counter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple] = []
    memory = torch.arange(4096, dtype=torch.int64).to(torch.uint8)

    def rebuild(*args: Any) -> torch.Tensor:
        calls.append(args)
        return memory

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    named = read_payload(raw(cuda_header(ref_counter)), LIMIT)
    assert calls == [
        (
            torch.Tensor,
            torch.Size([4096]),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            1,  # GPU-bbbb is this process's device 1
            FIELDS[1],
            4096,
            512,
            False,
            ref_counter.encode(),
            3,
            FIELDS[6],
            True,
        )
    ]
    assert [(n, t.dtype, tuple(t.shape)) for n, t in named] == [
        ("a", torch.float32, (2, 3)),
        ("b", torch.bfloat16, (4,)),
    ]
    assert torch.equal(named[1][1].view(torch.uint8), memory[64:72])  # views of the opened storage at their offsets


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"uuid": "GPU-cccc"}, "Invalid device_uuid=GPU-cccc"),
        ({"ref_offset": handles.CUDA_IPC_REF_COUNTERS}, "ref_counter_offset is out of range: 10000"),
        ({"ref_counter": "/torch_1_1_1"}, "no shared-memory file /torch_1_1_1"),
        ({"ref_counter": "/dev/nvidia0"}, "ref_counter is not a torch shared-memory file name"),
        ({"nbytes": 32}, "tensor 'b' of 8 bytes at offset 64 does not fit its buffer of 32 bytes"),
        ({"nbytes": LIMIT + 1}, f"the payload's buffers exceed {LIMIT} bytes"),
    ],
)
def test_a_cuda_buffer_is_checked_before_it_is_opened(
    two_gpus: None, ref_counter: str, monkeypatch: pytest.MonkeyPatch, change: dict, message: str
) -> None:
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: pytest.fail("opened before its checks"))
    with pytest.raises(ValueError, match=message):
        read_payload(raw(cuda_header(**{"ref_counter": ref_counter, **change})), LIMIT)


def test_a_short_reference_counter_file_is_refused_not_grown(
    two_gpus: None, ref_counter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: pytest.fail("opened before its checks"))
    path = Path("/dev/shm" + ref_counter)
    path.write_bytes(bytes(100))  # torch would map it at 80064 bytes, growing it, and count in it
    with pytest.raises(ValueError, match=f"the shared-memory file {ref_counter} holds 36 bytes, not the 80000"):
        read_payload(raw(cuda_header(ref_counter)), LIMIT)
    assert path.stat().st_size == 100


# ---- which format a sender writes ----


class _Engine:
    """Records the payloads an engine is sent."""

    def __init__(self) -> None:
        self.payloads: list[list[str]] = []

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None: ...

    async def update_weights_from_tensor(self, payloads: list[str], **kwargs: object) -> None:
        self.payloads.append(payloads)


def test_each_engine_gets_the_format_of_its_backend() -> None:
    engines = {"http://embedded:1": _Engine(), "http://sglang:1": _Engine()}
    endpoints = [EngineEndpoint("http://embedded:1", backend="embedded"), EngineEndpoint("http://sglang:1")]
    sender = TensorSender(SyncConfig(), endpoints, client_factory=engines.__getitem__)
    sender.connect()
    try:
        sender.push([("w", torch.arange(4.0))], version=1)
    finally:
        sender.close()
    [[own]], [[pickle]] = engines["http://embedded:1"].payloads, engines["http://sglang:1"].payloads
    assert base64.b64decode(own).startswith(MAGIC) and base64.b64decode(pickle)[:1] == b"\x80"
    assert sender.own_format == [True, False] and sender.pickles == 1
