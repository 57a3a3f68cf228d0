"""Tensor handles: memory of the trainer's that an engine maps by name, for `/update_weights_from_tensor`.

- CPU: a shared-memory file of torch's naming (`/dev/shm/torch_<pid>_<n>_<n>`: torch's `file_system` sharing,
  whatever the process's strategy is): an unrelated process (the engine server) can map it, where a file
  descriptor could only be passed to a child process. The file starts with torch's 64-byte header (its reference
  count); the storage's bytes follow.
- GPU: a CUDA IPC handle (torch's reduction) with the device given by its UUID instead of its index, as SGLang's
  patched reduction sends it: the trainer and the engine see different `CUDA_VISIBLE_DEVICES`.

Two payload formats name them: SGLang's pickle (`sglang_payload.py`), what the senders write to SGLang, and the
embedded engine's own (`embedded_payload.py`), which executes nothing. Both readers open a shared-memory file
only after checking its name, owner and real size (`open_shm`): torch maps a short file by growing it.

Persistent segments. The sender keeps its bucket memory across buckets and, on CPU, across pushes (on GPU it
gives it back after each push: `tensor_sender.py`). On CPU it holds a shared `flock` on each of its files for as
long as it keeps it (`hold`), and removes the file's name itself when it lets go (`retire`). An engine keeps what
it mapped of such a file (`Segments`), so later payloads naming it map nothing; it lets go of a segment a push did
not use (the sender grew it) and of one whose lock nobody holds any more (the sender is gone: the engine removes
the name). A file's memory goes with its last mapping. A CUDA segment is opened for each payload and closed once
loaded, as SGLang does: CUDA IPC memory stays allocated while a consumer has it open (a segment the sender grew
away from would stay until the push ended), and opening one costs little beside the copy. Segments are registered
by name (`SEGMENT_REGISTRY`), and a sender that starts removes those nobody holds (`sweep_segments`): torch's
`torch_shm_manager` would remove them once every process that registered them exited, but Ray kills it with the
actor.
"""

import base64
import binascii
import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

SHM_HANDLE = re.compile(rb"/torch_\d+_\d+_\d+")  # torch's names for shared-memory files
SHM_HEADER_BYTES = 64  # torch's header before a shared storage's bytes (its reference count, aligned)
CUDA_IPC_REF_COUNTERS = 10000  # int64 counters in one of torch's CUDA IPC reference-counter files


SHM_DIR = "/dev/shm"
# The names of the senders' segments on this machine, one empty file each: what a sender that starts may remove
# once nobody holds it (a run killed as a whole leaves its segments, and Ray kills torch's manager with the actor).
SEGMENT_REGISTRY = Path(tempfile.gettempdir()) / "userrl_segments"


def shm_path(handle: bytes) -> str:
    """The file of torch's shared-memory name `handle` (`/torch_...`)."""
    return SHM_DIR + handle.decode()


def hold(storage: torch.UntypedStorage) -> int:
    """Share `storage` by file name and take a shared lock on its file, kept until the returned descriptor is
    closed: engines tell a live sender's segment from a dead one's by it (the kernel drops the lock with the
    process)."""
    _, handle, _ = storage._share_filename_cpu_()
    fd = os.open(shm_path(handle), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    SEGMENT_REGISTRY.mkdir(exist_ok=True)
    SEGMENT_REGISTRY.joinpath(handle.decode().lstrip("/")).touch()
    return fd


def sweep_segments() -> list[str]:
    """Remove the registered segments nobody holds any more (their sender died with no engine left to notice), and
    the entries of segments already gone; returns the files removed."""
    removed = []
    for entry in SEGMENT_REGISTRY.glob("torch_*"):
        handle = b"/" + entry.name.encode()
        held = _held(handle)
        if held is False:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(handle))
                removed.append(entry.name)
        if not held:
            entry.unlink(missing_ok=True)
    return removed


def retire(storage: torch.UntypedStorage) -> None:
    """Remove the shared-memory file of `storage` now; its memory goes with the last mapping. One reference is
    kept for good first: torch's last close would otherwise remove the name again and abort on the missing file."""
    _, handle, _ = storage._share_filename_cpu_()
    storage._shared_incref()
    _unlink(handle)


def _held(handle: bytes) -> bool | None:
    """Whether a process holds a lock on the file of `handle` (None: the file is gone)."""
    try:
        fd = os.open(shm_path(handle), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass
class _Mapping:
    """The first `tensor.numel()` bytes of a shared-memory file, mapped read-only, and the file they belong to."""

    tensor: torch.Tensor
    file: tuple[int, int]  # (st_dev, st_ino)


class Segments:
    """The sender memory an engine keeps mapped between pushes: shared-memory files whose sender holds them
    (`hold`), by name. Mapping costs page faults per bucket otherwise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[bytes, _Mapping] = {}
        self._used: set[bytes] = set()  # files the open push read

    def map(self, handle: bytes, nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes of the shared-memory file `handle`: the kept mapping when it is of the same
        file and covers them, else a new one (`open_shm`), kept if the file's sender holds it."""
        with self._lock:
            kept = self._kept.get(handle)
        if kept is not None and kept.tensor.numel() >= nbytes and _file_id(handle) == kept.file:
            with self._lock:
                self._used.add(handle)
            return kept.tensor[:nbytes]
        tensor, file = open_shm(handle, nbytes)
        with self._lock:
            self._kept.pop(handle, None)
            if _held(handle):
                self._kept[handle] = _Mapping(tensor, file)
                self._used.add(handle)
        return tensor

    def names(self) -> list[bytes]:
        """The shared-memory files kept."""
        with self._lock:
            return list(self._kept)

    def end_push(self) -> None:
        """After a push: remove dead senders' files, then let go of what the push did not read (the sender grew or
        dropped it)."""
        self.reap()
        with self._lock:
            for key in [k for k in self._kept if k not in self._used]:
                del self._kept[key]
            self._used.clear()

    def reap(self) -> None:
        """Let go of files their sender removed, and remove those of a sender that is gone."""
        with self._lock:
            for handle in list(self._kept):
                held = _held(handle)
                if held is False:
                    _unlink(handle)
                if not held:
                    del self._kept[handle]
                    self._used.discard(handle)

    def clear(self) -> None:
        """Let go of everything (the engine stops), removing the files of senders that are gone."""
        self.reap()
        with self._lock:
            self._kept.clear()
            self._used.clear()


def open_shm(handle: bytes, nbytes: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """The first `nbytes` bytes of torch's shared-memory file `handle`, mapped read-only (a uint8 tensor), and the
    file's (device, inode). The file is opened without following links and mapped through that descriptor once it
    is known to be a regular file of this user holding those bytes: nothing is created or grown."""
    with _checked_shm(handle, nbytes) as (fd, info):
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), (info.st_dev, info.st_ino)
        mapping = mmap.mmap(fd, SHM_HEADER_BYTES + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only memory: nothing here writes to what it receives
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=SHM_HEADER_BYTES)
    return tensor, (info.st_dev, info.st_ino)


def check_shm(handle: bytes, nbytes: int) -> None:
    """ValueError unless torch's shared-memory file `handle` is a regular file of this user holding `nbytes`
    bytes after torch's header (what torch itself then maps: it would grow a shorter file)."""
    with _checked_shm(handle, nbytes):
        pass


def check_ref_counter(handle: bytes, offset: int) -> None:
    """ValueError unless `handle` names one of torch's CUDA IPC reference-counter files (a regular file of this
    user, of its full size) and `offset` one of its counters: torch increments that counter in place."""
    if type(offset) is not int or not 0 <= offset < CUDA_IPC_REF_COUNTERS:
        raise ValueError(f"a CUDA IPC reference counter offset must be in [0, {CUDA_IPC_REF_COUNTERS}), got {offset!r}")
    with _checked_shm(handle, 8 * CUDA_IPC_REF_COUNTERS):
        pass


@contextlib.contextmanager
def _checked_shm(handle: bytes, nbytes: int) -> Iterator[tuple[int, os.stat_result]]:
    if not isinstance(handle, bytes) or not SHM_HANDLE.fullmatch(handle):
        raise ValueError(f"not a torch shared-memory file name: {handle[:80]!r}")
    try:
        fd = os.open(shm_path(handle), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"no shared-memory file {handle.decode()}") from None
    except OSError as e:  # a link (O_NOFOLLOW), a FIFO's peer, a permission
        raise ValueError(f"cannot open the shared-memory file {handle.decode()}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"{handle.decode()} is not a shared-memory file of this server's user")
        if info.st_size < SHM_HEADER_BYTES + nbytes:
            raise ValueError(
                f"the shared-memory file {handle.decode()} holds {max(info.st_size - SHM_HEADER_BYTES, 0)} bytes, "
                f"not the {nbytes} the payload names"
            )
        yield fd, info
    finally:
        os.close(fd)


def _file_id(handle: bytes) -> tuple[int, int] | None:
    try:
        info = os.stat(shm_path(handle), follow_symlinks=False)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def _unlink(handle: bytes) -> None:
    """Remove the name of shared-memory file `handle` and its registry entry (its memory stays mapped)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(handle))
    SEGMENT_REGISTRY.joinpath(handle.decode().lstrip("/")).unlink(missing_ok=True)


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index` (how a handle names its device to another process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device with `uuid` (SGLang's message when it sees no such device)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(f"Invalid device_uuid={uuid}")


SHM_MANAGER_LATE = "Shared memory manager connection has timed out"
SHM_MANAGER_WAIT_S = 600.0  # only a hang makes torch's shared-memory manager this late


def through_shm_manager(call: Callable[[], T]) -> T:
    """`call()`, which creates or maps a shared-memory file registered with torch's shared-memory manager, tried
    again while the manager answers late. libshm waits 1 s for the manager's answer (hard-coded), which a busy
    machine misses; the registration still lands (the manager reads its socket in order), and nothing was
    created or mapped when it raises, so the call can be repeated."""
    deadline = time.monotonic() + SHM_MANAGER_WAIT_S
    while True:
        try:
            return call()
        except RuntimeError as e:
            if SHM_MANAGER_LATE not in str(e) or time.monotonic() >= deadline:
                raise
            log.warning("torch's shared-memory manager answered after its 1 s timeout: trying again")


def is_base64(text: str) -> bool:
    """Whether `text` decodes as strict base64 (SGLang's request validation refuses other payload strings)."""
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
