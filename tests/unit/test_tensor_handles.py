"""Tensor handles for `update_weights_from_tensor` (`wire/handles.py`), in both payload formats: a packed bucket
named by a shared-memory handle is read bit-exact by another, unrelated process; its memory file disappears once
both sides let go; an engine keeps a held segment mapped across pushes (the embedded engine's format); the receiver
reads only its own rank's entry and, for SGLang's pickle format (read only when asked), resolves only the globals
SGLang's unpickler allows and rebuilds tensors only inside their storages. The embedded format's own checks:
tests/unit/test_embedded_payload.py."""

import base64
import collections
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from tests.support.payloads import packed, plain_pickle
from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.sender import EngineEndpoint, _Packer
from userrl_megatron.sync.tensor_sender import SharedBuffer, TensorSender
from userrl_megatron.wire import handles
from userrl_megatron.wire.embedded_payload import write_payload
from userrl_megatron.wire.receive import decode_payload
from userrl_megatron.wire.sglang_payload import serialize

RECEIVER = textwrap.dedent(
    """
    import sys, torch
    from userrl_megatron.wire.receive import decode_payload

    def main():  # the mapped tensors are let go when it returns, as in a server's request handler
        load_format = sys.argv[2] if len(sys.argv) > 2 else None
        named = decode_payload([sys.stdin.read()], load_format, accept_pickle=True)
        torch.save({name: tensor.clone() for name, tensor in named}, sys.argv[1])

    main()
    """
)


def our_segments() -> set[str]:
    """Shared-memory files this process created (torch names them torch_<pid>_...)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def bucket_payload(packer: _Packer, own_format: bool = True) -> str:
    """A packed bucket's payload as `TensorSender` writes it: the embedded engine's format, or SGLang's pickle."""
    return TensorSender._payload(packer, own_format)


def receive(payload: str, out: Path, load_format: str | None = "flattened_bucket") -> dict[str, torch.Tensor]:
    """Decode `payload` in a fresh interpreter (not a child sharing our state: a separate `python -c`)."""
    cmd = [sys.executable, "-c", RECEIVER, str(out)] + ([load_format] if load_format else [])
    done = subprocess.run(cmd, input=payload, text=True, capture_output=True, timeout=600)  # a hang only
    assert done.returncode == 0, done.stderr
    return torch.load(out)


@pytest.mark.parametrize("own_format", [True, False], ids=["embedded", "pickle"])
def test_bucket_read_bit_exact_by_another_process_then_freed(tmp_path: Path, own_format: bool) -> None:
    before = our_segments()
    named = [
        ("a.weight", torch.randn(3, 5)),
        ("b.weight", torch.randn(7, 2).t()),  # strided source: packed contiguous
        ("c.bias", torch.tensor([1.5, -2.25, 3e-38])),
    ]
    packer = packed(named)
    assert [e[3:] for e in packer.entries] == [(0, 60), (60, 116), (116, 128)]  # bytes, back to back
    payload = bucket_payload(packer, own_format)
    assert len(base64.b64decode(payload)) < 2000  # a handle, not the 128 bytes... nor the 1 MB bucket
    assert len(our_segments() - before) == 1
    got = receive(payload, tmp_path / "got.pt")
    assert list(got) == ["a.weight", "b.weight", "c.bias"]
    for name, tensor in named:
        assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name
    packer.buffer.release()
    assert our_segments() == before  # the receiver let go of its mapping, the sender of its segment: the file is gone


@pytest.mark.parametrize("own_format", [True, False], ids=["embedded", "pickle"])
def test_receiver_sees_the_senders_bytes_not_a_copy_at_serialization(tmp_path: Path, own_format: bool) -> None:
    # The payload names memory: what the receiver reads is the bucket as it is when it maps it.
    packer = packed([("x", torch.zeros(4))])
    payload = bucket_payload(packer, own_format)
    packer.flat().view(torch.float32).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(receive(payload, tmp_path / "x.pt")["x"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    packer.buffer.release()


def test_named_tensor_lists_inline_bytes_and_plain_pickle_payloads(tmp_path: Path) -> None:
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    shared = receive(serialize([("w", tensor)]), tmp_path / "a.pt", load_format=None)
    assert shared["w"].dtype == torch.bfloat16 and torch.equal(shared["w"], tensor)
    held = tensor.clone()  # moved to a shared-memory file, which goes with it: the sender keeps it until answered
    shared = receive(write_payload([("w", held)]), tmp_path / "b.pt", load_format=None)
    assert shared["w"].dtype == torch.bfloat16 and torch.equal(shared["w"], tensor)
    (name, got), = decode_payload([write_payload([("w", tensor)], inline=True)], "direct")  # fmt: skip
    assert name == "w" and torch.equal(got, tensor)
    by_value = base64.b64encode(plain_pickle([("w", tensor)])).decode()  # SGLang accepts bytes inline too
    (name, got), = decode_payload([by_value], "direct", accept_pickle=True)  # fmt: skip
    assert name == "w" and torch.equal(got, tensor)


def test_only_own_rank_is_read_and_refusals() -> None:
    ok = base64.b64encode(plain_pickle([("w", torch.ones(2))])).decode()
    # Entry 1 is another TP rank's: never decoded (it would map that rank's memory).
    assert decode_payload([write_payload([("w", torch.ones(2))], inline=True), "not even base64!"], None)[0][0] == "w"
    with pytest.raises(IndexError, match=r"no payload for TP rank 0 \(0 given\)"):
        decode_payload([], None)
    with pytest.raises(NotImplementedError, match="Unknown load_format=safetensors"):
        decode_payload([ok], "safetensors")
    # Pickles only when asked for (`userrl serve --accept-pickle-payloads`): refused before a byte of them is read.
    with pytest.raises(ValueError, match=r"a pickle \(SGLang's format\), which this server reads only when started"):
        decode_payload([ok], None)
    with pytest.raises(ValueError, match=r"a payload starts with USERRLW1 \(this server's format\) or is a pickle"):
        decode_payload([base64.b64encode(b"PK\x03\x04").decode()], None, accept_pickle=True)
    with pytest.raises(pickle.UnpicklingError, match=r"Blocked unsafe global \(posix\.system\) during pickle"):
        decode_payload([base64.b64encode(pickle.dumps(os.system)).decode()], None, accept_pickle=True)
    with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
        decode_payload([base64.b64encode(pickle.dumps({"w": 1})).decode()], None, accept_pickle=True)
    with pytest.raises(ValueError, match="a flattened_bucket payload is a dict"):
        decode_payload([ok], "flattened_bucket", accept_pickle=True)


def test_bucket_sizes_follow_sync_config() -> None:
    # The sender's packer takes a shared segment of `sync.bucket_mb` (kept for the next buckets) and a view of it.
    before = our_segments()
    buffer = SharedBuffer("cpu")
    packer = _Packer(buffer)  # type: ignore[arg-type]
    packer.add("x", torch.ones(10), SyncConfig(bucket_mb=2).bucket_mb << 20)
    assert packer._flat is not None and packer._flat.untyped_storage().nbytes() == 2 << 20
    assert packer.flat().numel() == 40 and len(our_segments() - before) == 1
    packer.release()
    assert len(our_segments() - before) == 1  # the segment stays with its buffer
    buffer.release()
    assert our_segments() == before


ENGINE = textwrap.dedent(
    """
    import sys, torch
    from userrl_megatron.wire import handles
    from userrl_megatron.wire.receive import decode_payload

    segments = handles.Segments()
    mapped = []  # the files mapped (a kept mapping maps nothing)
    open_file = handles.open_shm
    def counted(handle, nbytes):
        mapped.append(handle)
        return open_file(handle, nbytes)
    handles.open_shm = counted
    for line in sys.stdin:
        command, _, payload = line.strip().partition(" ")
        if command == "load":
            named = decode_payload([payload], "flattened_bucket", segments=segments)
            print(" ".join(str(t.tolist()) for _, t in named), flush=True)
            del named  # the request is answered: only what `segments` keeps stays mapped
        elif command == "end":
            segments.end_push()
        elif command == "stop":
            segments.clear()
        print(len(segments.names()), len(mapped), flush=True)
    """
)


class EngineProcess:
    """A fresh interpreter that decodes payloads line by line and keeps what it maps, like the embedded server
    (which reads its own format from the trainer's senders)."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-c", ENGINE]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        lines = [self.proc.stdout.readline().strip() for _ in range(2 if line.startswith("load") else 1)]
        assert all(lines), "the engine process died"
        return lines

    def load(self, packer: _Packer) -> tuple[str, tuple[int, int]]:
        """(the tensors read, (segments kept, mappings made so far))."""
        got, counts = self.ask("load " + bucket_payload(packer))
        kept, mapped = counts.split()
        return got, (int(kept), int(mapped))

    def counts(self, command: str = "count") -> tuple[int, int]:
        kept, mapped = self.ask(command)[0].split()
        return int(kept), int(mapped)


def bucket(buffer: SharedBuffer, value: float, n: int = 4) -> _Packer:
    packer = _Packer(buffer)  # type: ignore[arg-type]
    packer.add("w", torch.full((n,), value), 1 << 10)
    return packer


def test_segments_are_reused_and_the_engine_maps_each_once() -> None:
    before = our_segments()
    engine, buffer = EngineProcess(), SharedBuffer("cpu")
    try:
        for value in (1.0, 2.0, 3.0):  # three buckets written in place into one segment, read bit-exact
            packer = bucket(buffer, value)
            assert engine.load(packer) == (str([value] * 4), (1, 1))
            packer.release()
        assert len(our_segments() - before) == 1
        old = our_segments() - before
        packer = bucket(buffer, 4.0, n=1024)  # a bucket larger than the segment: a new one, the old file goes now
        assert engine.load(packer) == (str([4.0] * 1024), (2, 2))
        assert len(our_segments() - before) == 1 and not old & our_segments()
        assert engine.counts("end") == (1, 2)  # the push did not read the old segment: let go
        loose = torch.tensor([1.5, 2.5])  # shared by a sender that does not hold its file
        assert engine.ask("load " + write_payload([("v", loose)])) == ["[1.5, 2.5]", "1 3"]  # for this payload only
        del loose
        buffer.release()
        assert our_segments() == before
        assert engine.counts("end") == (0, 3)  # the sender removed it: let go
    finally:
        engine.proc.kill()
        engine.proc.wait()
        buffer.release()


def test_no_segment_is_left_after_the_engine_is_killed() -> None:
    before = our_segments()
    engine, buffer = EngineProcess(), SharedBuffer("cpu")
    assert engine.load(bucket(buffer, 5.0))[1] == (1, 1)
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait()
    buffer.release()  # the dead engine's reference is never given back: the sender removes the file itself
    assert our_segments() == before


SENDER = textwrap.dedent(
    """
    import sys, time, torch
    from userrl_megatron.sync.sender import _Packer
    from userrl_megatron.sync.tensor_sender import SharedBuffer, TensorSender

    packer = _Packer(SharedBuffer("cpu"))
    packer.add("w", torch.full((4,), 7.0), 1024)
    print(TensorSender._payload(packer, True), flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.parametrize("found_at", ["end", "stop"])
def test_no_segment_is_left_after_the_sender_is_killed(found_at: str) -> None:
    """The engine finds the file nobody holds when the next push ends or when it stops, and removes it."""
    sender = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, text=True)
    engine = EngineProcess()
    try:
        assert sender.stdout is not None
        got, counts = engine.ask("load " + sender.stdout.readline().strip())
        assert got == str([7.0] * 4) and counts == "1 1"
        theirs = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{sender.pid}_")]
        assert len(theirs) == 1
        assert engine.counts("end") == (1, 1)  # its sender holds it: kept
        sender.send_signal(signal.SIGKILL)
        sender.wait()
        assert os.path.exists(f"/dev/shm/{theirs[0]}")
        assert engine.counts(found_at) == (0, 1)
        assert not os.path.exists(f"/dev/shm/{theirs[0]}")
    finally:
        sender.kill()
        engine.proc.kill()
        engine.proc.wait()


def test_payload_holders_follow_the_placement() -> None:
    from userrl_megatron.sync.sender import EngineEndpoint
    from userrl_megatron.sync.tensor_sender import payload_holders

    # Colocated: engine e's TP rank j on device 2e + j; the stage's TP group is ranks 0-3 (source 0).
    colocated = [EngineEndpoint(f"e{e}", 2, first_device=2 * e) for e in range(3)]
    assert payload_holders(colocated, [0, 1, 2, 3]) == [[0, 1], [2, 3], [0, 0]]  # devices 4, 5: no actor rank
    # A second pipeline stage's TP group (ranks 4, 5, source 4) holds the copies for devices 4 and 5 only.
    assert payload_holders(colocated, [4, 5]) == [[4, 4], [4, 4], [4, 5]]
    # Disaggregated engines (after 4 actor devices) and engines of unknown placement map the source's copy.
    assert payload_holders([EngineEndpoint("x", 2, first_device=4), EngineEndpoint("y")], [0, 1, 2, 3]) == [
        [0, 0],
        [0],
    ]


class Reduce:
    """Pickles as `fn(*args)`: how a hostile payload names any allowed global with arguments of its choice."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def hostile(obj: object) -> str:
    return base64.b64encode(plain_pickle([("w", obj)])).decode()


def one_float_storage() -> torch.TypedStorage:
    with warnings.catch_warnings():  # TypedStorage is deprecated: a payload still may hold one
        warnings.simplefilter("ignore", UserWarning)
        return torch.ones(1).storage()


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        # torch grows a storage too short for the view with uninitialised memory: 576 floats from 1.
        (
            Reduce(torch._utils._rebuild_tensor, one_float_storage(), 0, (576,), (1,)),
            r"a tensor of size \[576\] \(stride \[1\], offset 0\) does not fit its storage of 4 bytes",
        ),
        (
            Reduce(
                torch._utils._rebuild_tensor_v2, one_float_storage(), 1, (1,), (1,), False, collections.OrderedDict()
            ),
            r"a tensor of size \[1\] \(stride \[1\], offset 1\) does not fit its storage of 4 bytes",
        ),
        # An overlapping view larger than its storage (stride 0): every later reshape would copy it out.
        (
            Reduce(torch._utils._rebuild_tensor, one_float_storage(), 0, (1 << 40,), (0,)),
            r"a tensor of size \[1099511627776\] \(stride \[0\], offset 0\) does not fit its storage of 4 bytes",
        ),
        (Reduce(torch._utils._rebuild_tensor, one_float_storage(), -1, (1,), (1,)), "a bad tensor view: offset -1"),
        (bytearray(b"x"), r"Blocked unsafe global \(builtins\.bytearray\) during pickle deserialization"),
        (range(10**12), r"Blocked unsafe global \(builtins\.range\) during pickle deserialization"),
        (Reduce(bytes, 10**12), r"bytes\(n\) is not allowed in a weight payload"),
        (Reduce(torch.UntypedStorage, 10**12), "constructing UntypedStorage is not allowed in a weight payload"),
        (Reduce(torch.Tensor, 576), "constructing Tensor is not allowed in a weight payload"),
        (
            Reduce(reductions.rebuild_storage_filename, torch.UntypedStorage, b"/m.sock", b"/torch_1_2_3", 10**15),
            r"a storage of 1000000000000000 bytes \(at most 1073741824\)",
        ),
        (
            Reduce(reductions.rebuild_storage_filename, torch.UntypedStorage, b"/m.sock", b"/etc/passwd", 8),
            r"not a torch shared-memory file name: b'/etc/passwd'",
        ),
    ],
    ids=[
        "576-from-1",
        "offset-past-end",
        "stride-0",
        "negative-offset",
        "bytearray",
        "range",
        "bytes-n",
        "untyped-storage-n",
        "tensor-n",
        "huge-shared-file",
        "not-a-torch-file",
    ],
)
def test_hostile_payloads_are_refused(obj: object, message: str) -> None:
    with pytest.raises(pickle.UnpicklingError, match=message):
        decode_payload([hostile(obj)], None, accept_pickle=True)


def test_a_payload_holds_at_most_max_bytes_of_storages_and_of_tensors() -> None:
    # Two storages of 64 bytes by value: each within 100 bytes, together not.
    payload = base64.b64encode(plain_pickle([("a", torch.ones(16)), ("b", torch.ones(16))])).decode()
    assert [name for name, _ in decode_payload([payload], None, max_bytes=128, accept_pickle=True)] == ["a", "b"]
    with pytest.raises(pickle.UnpicklingError, match="the payload's storages exceed 100 bytes"):
        decode_payload([payload], None, max_bytes=100, accept_pickle=True)
    # One shared storage of 64 bytes read as two tensors of 64 bytes.
    tensor = torch.ones(16)
    shared = serialize([("a", tensor), ("b", tensor.view(4, 4))])
    assert [name for name, _ in decode_payload([shared], None, max_bytes=128, accept_pickle=True)] == ["a", "b"]
    with pytest.raises(pickle.UnpicklingError, match="the payload's tensors exceed 100 bytes"):
        decode_payload([shared], None, max_bytes=100, accept_pickle=True)


LATE = RuntimeError("Shared memory manager connection has timed out\nException raised from recv at socket.h:67")


def test_a_late_shared_memory_manager_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """libshm gives torch's shared-memory manager 1 s to answer; a busy machine misses it (a colocated run failed
    its push under load): the bucket is taken again, and the engine side maps it again, until the manager answers."""
    real = torch.UntypedStorage._new_using_filename_cpu
    answers = iter([LATE, LATE])

    def late_then_real(nbytes: int) -> torch.UntypedStorage:
        failure = next(answers, None)
        if failure is not None:
            raise failure
        return real(nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "_new_using_filename_cpu", late_then_real)
    bucket = SharedBuffer().take(64)
    assert bucket.numel() == 64 and next(answers, "used") == "used"
    bucket[:] = 7
    payload = serialize([("w", bucket)])

    rebuild = reductions.rebuild_storage_filename
    tries = iter([LATE])

    def late_rebuild(*args: object) -> object:
        failure = next(tries, None)
        if failure is not None:
            raise failure
        return rebuild(*args)

    monkeypatch.setattr(reductions, "rebuild_storage_filename", late_rebuild)
    [(name, mapped)] = decode_payload([payload], None, accept_pickle=True)
    assert name == "w" and torch.equal(mapped, bucket) and next(tries, "used") == "used"


def test_other_failures_and_a_hung_manager_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fail(error: Exception) -> None:
        calls.append(1)
        raise error

    with pytest.raises(RuntimeError, match=r"^unable to open shared memory object$"):
        handles.through_shm_manager(lambda: fail(RuntimeError("unable to open shared memory object")))
    assert len(calls) == 1
    monkeypatch.setattr(handles, "SHM_MANAGER_WAIT_S", 0.0)
    with pytest.raises(RuntimeError, match=r"^Shared memory manager connection has timed out"):
        handles.through_shm_manager(lambda: fail(LATE))
    assert len(calls) == 2


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int(entry.joinpath("stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def test_segments_of_a_run_killed_as_a_whole_go_when_the_next_sender_starts() -> None:
    sender = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline()  # its segment is made, held and registered
        theirs = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{sender.pid}_")]
        assert len(theirs) == 1 and (handles.SEGMENT_REGISTRY / theirs[0]).exists()
        assert theirs[0] not in handles.sweep_segments()  # held by its sender: left alone
        for pid in [*children(sender.pid), sender.pid]:  # as Ray does: torch's shm manager dies with the actor
            os.kill(pid, signal.SIGKILL)
        sender.wait()
        assert os.path.exists(f"/dev/shm/{theirs[0]}")  # no engine, no manager: nobody removed it
        # The next sender on this machine removes what nobody holds any more.
        TensorSender(SyncConfig(), [EngineEndpoint("http://e:1")], client_factory=lambda url: None).close()
        assert not os.path.exists(f"/dev/shm/{theirs[0]}") and not (handles.SEGMENT_REGISTRY / theirs[0]).exists()
    finally:
        sender.kill()
