"""The bounded reader of SGLang's pickle format (`wire/sglang_payload.py`), which the embedded engine uses only
when started with --accept-pickle-payloads: it reads what torch's and SGLang's reductions write (the senders'
buckets, tensors by value), and refuses, before the harm, what issue 57 found a pickle could do: BUILD a tensor
over memory it does not own (N1), a dict key nested so deep or so shared that hashing it crashed the engine or
ran for hours (N2, N3), storages by value inflated from compressed records or adding up past the bound (N4), and
a shared-memory file grown to the size a payload names. The same cases against a real server:
tests/e2e/test_hostile_payloads.py."""

import base64
import collections
import io
import os
import pickle
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from tests.support.payloads import packed, plain_pickle
from userrl_megatron.sync.tensor_sender import bucket_entries
from userrl_megatron.wire import handles, sglang_payload
from userrl_megatron.wire.sglang_payload import MAX_DEPTH, flattened_bucket, read_pickle, serialize


class Reduce:
    """Pickles as `fn(*args)`, then BUILD with `state` when given."""

    def __init__(self, fn: object, *args: object, state: object = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self) -> tuple:
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def read(data: bytes, load_format: str | None = None, max_bytes: int = 1 << 30) -> list:
    return read_pickle(data, load_format, max_bytes)


def typed_ones(n: int) -> torch.TypedStorage:
    return torch.TypedStorage(wrap_storage=torch.ones(n).untyped_storage(), dtype=torch.float32, _internal=True)


def one_element(storage: object) -> Reduce:
    return Reduce(torch._utils._rebuild_tensor_v2, storage, 0, (1,), (1,), False, collections.OrderedDict())


def test_what_the_senders_write_is_read() -> None:
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(4).bfloat16())]
    packer = packed(named[:1])
    try:
        flat = serialize(flattened_bucket(packer.flat(), bucket_entries(packer.entries)))
        [(name, got)] = read(base64.b64decode(flat), "flattened_bucket")
        assert name == "a" and torch.equal(got, named[0][1])
    finally:
        packer.buffer.release()
    by_value = read(plain_pickle(named))
    assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(by_value, named, strict=True))


def test_n1_build_on_a_tensor_is_refused() -> None:
    storage = typed_ones(1)
    grown = one_element(storage)
    grown.state = (storage, 0, torch.Size([576]), (1,))  # Tensor.__setstate__ -> set_(): 575 floats of heap
    with pytest.raises(pickle.UnpicklingError, match="BUILD on a Tensor is not allowed in a weight payload"):
        read(plain_pickle([("w", grown)]))


def test_n2_n3_deep_and_shared_containers_are_refused_before_any_hash() -> None:
    chain = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns."  # {((...(),),): None}, 10^6 deep: SIGSEGV before
    dag = bytearray(b"\x80\x04})\x94")
    for i in range(40):  # t(i+1) = (t(i), t(i)): hashing t40 took hours
        dag += b"h" + bytes([i]) + b"\x86\x94"
    started = time.monotonic()
    for payload in (chain, bytes(dag + b"Ns.")):
        with pytest.raises(pickle.UnpicklingError, match=f"containers nested deeper than {MAX_DEPTH} levels"):
            read(payload)
    assert time.monotonic() - started < 30  # the chain is read up to depth 17 only
    # Within the depth, a container is still no dict key: only scalars are hashed.
    with pytest.raises(pickle.UnpicklingError, match="dict keys in a weight payload are str, bytes, numbers or None"):
        read(b"\x80\x04})\x85Ns.")
    # A list nested too deep by APPEND, a dict by SETITEM.
    with pytest.raises(pickle.UnpicklingError, match="nested deeper than"):
        read(b"\x80\x04" + b"]" * 40 + b"a" * 39 + b".")
    nested = bytearray(b"\x80\x04}\x94")
    for i in range(40):  # d(i+1) = {0: d(i)}
        nested += b"}K\x00h" + bytes([i]) + b"s\x94"
    with pytest.raises(pickle.UnpicklingError, match="nested deeper than"):
        read(bytes(nested + b"."))


def test_the_memo_and_the_opcodes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_payload, "MAX_MEMO", 4)
    with pytest.raises(pickle.UnpicklingError, match="the pickle memo of a weight payload holds at most 4 objects"):
        read(b"\x80\x04" + b"N\x94" * 5 + b".")
    monkeypatch.setattr(sglang_payload, "MAX_OPS", 100)
    with pytest.raises(pickle.UnpicklingError, match="a weight payload runs at most 100 pickle opcodes"):
        read(b"\x80\x04]" + b"Na" * 60 + b".")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\x80\x04\x8f\x94.", "pickle opcode EMPTY_SET is not allowed"),  # sets hash their items
        (b"\x80\x04(K\x01\x91.", "pickle opcode FROZENSET is not allowed"),
        (b"\x80\x04N0.", "pickle opcode POP is not allowed"),
        (b"\x80\x04\x8c\x01xQ.", "pickle opcode BINPERSID is not allowed"),
        (b"\x80\x04\x82\x01.", "pickle opcode EXT1 is not allowed"),
        (b"\x80\x04\x97.", "pickle opcode NEXT_BUFFER is not allowed"),
        (b"I1\n.", "pickle opcode INT is not allowed"),
        (b"\x80\x04N", "the pickle ends before its STOP"),
        (pickle.dumps({1, 2}), r"Blocked unsafe global \(builtins\.set\)|opcode EMPTY_SET"),
        (pickle.dumps(frozenset([1])), "opcode FROZENSET"),
        (pickle.dumps(Reduce(dict, [((1,), 2)])), r"Blocked unsafe global \(builtins\.dict\)"),
        (pickle.dumps(Reduce(collections.OrderedDict, [((1,), 2)])), "an OrderedDict in a weight payload is empty"),
        (b"\x80\x04N)R.", "REDUCE calls only a global of the payload"),  # None(*()): a value is not a global
        (b"\x80\x04)N\x81.", "NEWOBJ makes only tensor metadata"),
        (b"\x80\x04K\x01}b.", "BUILD on a int is not allowed"),
        (b"\x80\x04K\x01Na.", "APPEND to a int is not allowed"),
        (b"\x80\x04K\x01NNs.", "SETITEM on a int is not allowed"),
    ],
)
def test_only_the_opcode_shapes_of_torchs_reductions_run(payload: bytes, message: str) -> None:
    with pytest.raises(pickle.UnpicklingError, match=message):
        read(payload)


def test_a_message_never_shows_a_hostile_container() -> None:
    wide = tuple(range(100))
    with pytest.raises(pickle.UnpicklingError, match=r"size must be a sequence of non-negative integers, got a tuple$"):
        read(plain_pickle([("w", Reduce(torch._utils._rebuild_tensor, typed_ones(1), 0, (wide,) * 2, (1,)))]))


def deflated(storage: torch.TypedStorage) -> bytes:
    """`storage` as torch.save writes it (a zip archive), its records recompressed with deflate."""
    saved, out = io.BytesIO(), io.BytesIO()
    torch.save(storage, saved)
    source = zipfile.ZipFile(io.BytesIO(saved.getvalue()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            archive.writestr(name, source.read(name))
    return out.getvalue()


class ByValue:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple:
        return torch.storage._load_from_bytes, (self.data,)


def test_n4_storages_by_value_are_read_only_in_torchs_legacy_format_and_bounded_in_total() -> None:
    zipped = deflated(torch.zeros(1 << 20).storage())  # 4 MiB in 4 KB
    with pytest.raises(pickle.UnpicklingError, match="a storage by value in a zip archive is refused"):
        read(plain_pickle([("w", one_element(ByValue(zipped)))]))
    legacy = [torch.zeros(1 << 10).storage() for _ in range(3)]  # 4 KiB each
    assert len(read(plain_pickle([("w", one_element(s)) for s in legacy]), max_bytes=3 << 12)) == 3
    with pytest.raises(pickle.UnpicklingError, match="the payload's storages exceed 12000 bytes"):
        read(plain_pickle([("w", one_element(s)) for s in legacy]), max_bytes=12000)


def legacy_bytes(storage: torch.TypedStorage) -> bytes:
    return storage.__reduce__()[1][0]


def test_a_storage_by_value_is_checked_before_it_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    good = legacy_bytes(torch.arange(4.0).storage())
    [(_, got)] = read(plain_pickle([("w", Reduce(torch._utils._rebuild_tensor, ByValue(good), 0, (4,), (1,)))]))
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    allocated: list[int] = []
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: allocated.append(1))
    # The record says 2^31 floats and holds 4: refused from its numbers, nothing allocated.
    assert good.count(b"K\x04Ntq") == 1  # the record's element count
    huge = good.replace(b"K\x04Ntq", b"J\xff\xff\xff\x7fNtq")  # 2^31 - 1 floats
    with pytest.raises(pickle.UnpicklingError, match=r"a storage of 8589934588 bytes \(at most 1073741824\)"):
        read(plain_pickle([("w", one_element(ByValue(huge)))]))
    with pytest.raises(pickle.UnpicklingError, match="a storage by value of 4 elements holds other bytes"):
        read(plain_pickle([("w", one_element(ByValue(good + b"x")))]))
    with pytest.raises(pickle.UnpicklingError, match="a storage by value is in torch's legacy format"):
        read(plain_pickle([("w", one_element(ByValue(b"\x80\x02K\x01.")))]))
    assert allocated == []


@pytest.fixture
def short_shm_file() -> Iterator[bytes]:
    path = Path(f"/dev/shm/torch_{os.getpid()}_4343_{id(object())}")
    path.write_bytes(bytes(handles.SHM_HEADER_BYTES + 8))
    yield f"/{path.name}".encode()
    path.unlink(missing_ok=True)


def test_a_shared_memory_file_is_checked_before_torch_maps_it(short_shm_file: bytes) -> None:
    manager = b"/tmp/torch-shm-dir-abc123/manager.sock"
    rebuild = Reduce(reductions.rebuild_storage_filename, torch.UntypedStorage, manager, short_shm_file, 1 << 20)
    with pytest.raises(ValueError, match=r"holds 8 bytes, not the 1048576 the payload names"):
        read(plain_pickle([("w", rebuild)]))
    assert Path("/dev/shm" + short_shm_file.decode()).stat().st_size == handles.SHM_HEADER_BYTES + 8  # not grown
    rebuild = Reduce(reductions.rebuild_storage_filename, torch.UntypedStorage, b"/run/docker.sock", short_shm_file, 8)
    with pytest.raises(pickle.UnpicklingError, match=r"not torch's shared-memory manager socket: b'/run/docker\.sock'"):
        read(plain_pickle([("w", rebuild)]))
