"""The payload format of SGLang's `/update_weights_from_tensor`: tensors that travel as handles, not bytes.

A payload is a `multiprocessing` ForkingPickler pickle (SGLang's `MultiprocessingSerializer`), base64 in the
JSON body, one per engine TP rank. Tensors inside it are references to memory the sender keeps alive until the
engine answers:
- CUDA tensors: CUDA IPC handles (torch's reduction) with the device given by its UUID instead of its index, as
  SGLang's patched reduction sends it: the trainer and the engine see different `CUDA_VISIBLE_DEVICES`;
- CPU tensors: the name of a shared-memory file (torch's `file_system` sharing strategy, whatever the process's
  strategy is): an unrelated process (the engine server) can map it, where a file descriptor could only be
  passed to a child process.

Persistent segments. The sender keeps its bucket memory across buckets and, on CPU, across pushes (on GPU it
gives it back after each push: `tensor_sender.py`). On CPU it holds a shared `flock` on each of its files for as
long as it keeps it (`hold`), and removes the file's name itself when it lets go (`retire`). An engine keeps what
it mapped of such a file (`Segments`), so later payloads naming it map nothing (torch's `shared_cache` returns the
live storage); it lets go of a segment a push did not use (the sender grew it) and of one whose lock nobody holds
any more (the sender is gone: the engine removes the name). A file's memory goes with its last mapping. A CUDA
segment is opened for each payload and closed once loaded, as SGLang does: CUDA IPC memory stays allocated while
a consumer has it open (a segment the sender grew away from would stay until the push ended), and opening one
costs little beside the copy. Segments are registered by name (`SEGMENT_REGISTRY`), and a sender that starts
removes those nobody holds (`sweep_segments`): torch's `torch_shm_manager` would remove them once every process
that registered them exited, but Ray kills it with the actor.

`load_format: "flattened_bucket"` payloads hold `{"flattened_tensor": uint8 tensor, "metadata": [...]}`, each
metadata entry with the attributes of SGLang's `FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx,
numel). The sender writes them as `types.SimpleNamespace` (SGLang's unpickler allows it; the trainer has no
SGLang to import its class from); the receiver takes either.

Receiving (the embedded server) follows SGLang 0.5.23's `SafeUnpickler`: only the globals such a payload needs
are resolved; anything else is refused with SGLang's message. It is stricter than SGLang's: a tensor is rebuilt
only inside its storage and no larger than it (torch would grow a short storage with uninitialised memory), the
tensors of one payload hold at most `max_bytes` together and no storage is larger, shared memory is named only
as torch names it, tensor and storage classes are arguments never called (`torch.Tensor(n)` allocates), and
`bytearray`, `range` and `bytes(n)` are refused.
"""

import base64
import binascii
import builtins
import codecs
import collections
import contextlib
import copyreg
import fcntl
import functools
import io
import logging
import math
import os
import pickle
import re
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing.reductions as reductions

from userrl_megatron.sync.bucket import BucketEntry

log = logging.getLogger(__name__)
T = TypeVar("T")

LOAD_FORMATS = (None, "direct", "flattened_bucket")
CUDA_DEVICE_ARG = 6  # position of the device index in the arguments of torch's `rebuild_cuda_tensor`


class HandlePickler(ForkingPickler):
    """ForkingPickler whose CPU storages travel by shared-memory file name and CUDA tensors by device UUID."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = _reduce_tensor


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Callable, tuple]:
    """torch's `file_system` reduction: the storage moves to (or already is in) a named shared-memory file; the
    reference taken here is handed to the receiver, whose rebuild releases it."""
    if storage.device.type != "cpu":
        raise ValueError(f"a {storage.device.type} storage cannot be shared by file name")
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = list(args)
        args[CUDA_DEVICE_ARG] = str(torch.cuda.get_device_properties(args[CUDA_DEVICE_ARG]).uuid)
        args = tuple(args)
    return rebuild, args


def serialize(obj: Any) -> str:
    """A base64 ForkingPickler payload of `obj` in which tensors are handles (see the module docstring).

    Each call hands out one reference per CPU storage: serialize once per receiving engine TP rank."""
    buffer = io.BytesIO()
    HandlePickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def withdraw(tensor: torch.Tensor, count: int) -> None:
    """Take back the references `count` serializations of `tensor` handed out, for payloads nobody will read
    (never posted): else its shared-memory file would outlive the tensor. CUDA memory needs nothing here."""
    if tensor.device.type == "cpu":
        for _ in range(count):
            tensor.untyped_storage()._shared_decref()


def flattened_bucket(flat: torch.Tensor, layout: Sequence[BucketEntry]) -> dict[str, Any]:
    """The `flattened_bucket` payload object of one packed bucket."""
    return {
        "flattened_tensor": flat,
        "metadata": [
            types.SimpleNamespace(
                name=e.name,
                shape=torch.Size(e.shape),
                dtype=e.dtype,
                start_idx=e.start,
                end_idx=e.end,
                numel=e.end - e.start,
            )
            for e in layout
        ],
    }


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
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(handle))
    SEGMENT_REGISTRY.joinpath(handle.decode().lstrip("/")).unlink(missing_ok=True)


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


class Segments:
    """The sender memory an engine keeps mapped between pushes: shared-memory files whose sender holds them
    (`hold`), by name. Mapping costs page faults per bucket otherwise; a kept storage makes torch's rebuild find
    it in its `shared_cache`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[bytes, torch.UntypedStorage] = {}
        self._used: set[bytes] = set()  # files the open push read

    def keep_file(self, handle: bytes, storage: torch.UntypedStorage) -> None:
        """Keep a mapped shared-memory file if its sender holds it (a file nobody holds is mapped per payload)."""
        with self._lock:
            if handle not in self._kept and not _held(handle):
                return
            self._kept[handle] = storage
            self._used.add(handle)

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
                    retire(self._kept[handle])
                if not held:
                    del self._kept[handle]
                    self._used.discard(handle)

    def clear(self) -> None:
        """Let go of everything (the engine stops), removing the files of senders that are gone."""
        self.reap()
        with self._lock:
            self._kept.clear()
            self._used.clear()


# ---- receiving (the embedded server) ----


@dataclass
class FlattenedTensorMetadata:
    """Stands in for SGLang's class of that name when a payload written with SGLang installed names it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _Budget:
    """What one payload may make the engine hold: tensors of `max_bytes` together, no storage larger."""

    def __init__(self, max_bytes: int, segments: Segments | None = None) -> None:
        self.max_bytes, self.used = max_bytes, 0
        self.tensor_rebuilds: list[Any] = []  # this payload's bound tensor rebuilds (_rebuild_from_type_v2 calls)
        self.segments = segments  # where the receiving engine keeps what it maps (None: nothing is kept)

    def storage(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= self.max_bytes:
            raise pickle.UnpicklingError(f"a storage of {nbytes!r} bytes (at most {self.max_bytes})")

    def tensor(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.max_bytes:
            raise pickle.UnpicklingError(f"the payload's tensors exceed {self.max_bytes} bytes")


@dataclass(frozen=True)
class _ClassRef:
    """A class the payload names as an argument (a tensor or storage type), never constructs: calling it would
    allocate uninitialised memory (`torch.Tensor(n)`, `torch.UntypedStorage(n)`)."""

    cls: type

    def __call__(self, *args: Any) -> Any:
        raise pickle.UnpicklingError(f"constructing {self.cls.__name__} is not allowed in a weight payload")


def _unwrap(ref: Any, allowed: tuple[type, ...]) -> type:
    if not isinstance(ref, _ClassRef) or ref.cls not in allowed:
        raise pickle.UnpicklingError(f"expected one of {', '.join(c.__name__ for c in allowed)}, got {ref!r}")
    return ref.cls


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError(f"{what} must be a sequence of non-negative integers, got {value!r}")
    return tuple(value)


def _check_view(budget: _Budget, nbytes: int, itemsize: int, offset: Any, size: Any, stride: Any) -> None:
    """A tensor of `size`/`stride` at element `offset` reads only its storage's `nbytes` and is no larger than
    it (torch would grow the storage with uninitialised memory; an overlapping view could be huge)."""
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride):
        raise pickle.UnpicklingError(f"a bad tensor view: offset {offset!r}, size {size}, stride {stride}")
    numel = math.prod(size)
    extent = 0 if numel == 0 else offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if extent * itemsize > nbytes or numel * itemsize > nbytes - min(nbytes, offset * itemsize):
        raise pickle.UnpicklingError(
            f"a tensor of size {list(size)} (stride {list(stride)}, offset {offset}) does not fit its storage "
            f"of {nbytes} bytes"
        )
    budget.tensor(numel * itemsize)


def _fitted(budget: _Budget, storage: Any, offset: Any, size: Any, stride: Any) -> torch.TypedStorage:
    """`storage`, a typed storage that the tensor view `offset`/`size`/`stride` lies inside (`_check_view`)."""
    if not isinstance(storage, torch.TypedStorage):
        raise pickle.UnpicklingError(f"expected a typed storage, got {type(storage).__name__}")
    _check_view(budget, storage._untyped_storage.nbytes(), storage.dtype.itemsize, offset, size, stride)
    return storage


def _rebuild_tensor(budget: _Budget, storage: Any, offset: Any, size: Any, stride: Any) -> torch.Tensor:
    typed = _fitted(budget, storage, offset, size, stride)
    return torch._utils._rebuild_tensor(typed, offset, size, stride)


def _rebuild_tensor_v2(
    budget: _Budget, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, *meta: Any
) -> torch.Tensor:
    if hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks")
    typed = _fitted(budget, storage, offset, size, stride)
    return torch._utils._rebuild_tensor_v2(typed, offset, size, stride, bool(requires_grad), hooks, *meta)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.nn.Parameter:
    if not isinstance(data, torch.Tensor) or hooks:
        raise pickle.UnpicklingError("a parameter is rebuilt from a tensor, without backward hooks")
    return torch._utils._rebuild_parameter(data, bool(requires_grad), hooks)


def _rebuild_from_type(budget: _Budget, func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor:
    if not any(func is f for f in budget.tensor_rebuilds) or not isinstance(args, tuple) or state:
        raise pickle.UnpicklingError("a tensor subclass is rebuilt only from a tensor rebuild, without state")
    return torch._tensor._rebuild_from_type_v2(func, _unwrap(new_type, _TENSOR_TYPES), args, state)


def _mp_rebuild_tensor(budget: _Budget, cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    """torch's `multiprocessing.reductions.rebuild_tensor`, checked."""
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise pickle.UnpicklingError("tensor metadata is (offset, size, stride, requires_grad)")
    offset, size, stride, requires_grad = metadata
    typed = _fitted(budget, storage, offset, size, stride)
    return reductions.rebuild_tensor(_unwrap(cls, _TENSOR_TYPES), typed, (offset, size, stride, bool(requires_grad)))


def _rebuild_typed_storage(storage: Any, dtype: Any) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("a typed storage wraps an untyped storage with a dtype")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_storage_filename(
    budget: _Budget, cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None
) -> torch.UntypedStorage | torch.TypedStorage:
    """A shared-memory file of torch's naming (`/torch_<pid>_<n>_<n>`) of at most the budget's bytes."""
    cls = _unwrap(cls, _STORAGE_TYPES)
    if not isinstance(handle, bytes) or not SHM_HANDLE.fullmatch(handle) or not isinstance(manager, bytes):
        raise pickle.UnpicklingError(f"not a torch shared-memory file name: {handle!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a dtype: {dtype!r}")
    budget.storage(size if dtype is None or type(size) is not int else size * dtype.itemsize)
    storage = through_shm_manager(lambda: reductions.rebuild_storage_filename(cls, manager, handle, size, dtype))
    if budget.segments is not None:
        budget.segments.keep_file(
            handle, storage if isinstance(storage, torch.UntypedStorage) else storage._untyped_storage
        )
    return storage


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


def _rebuild_storage_empty(cls: Any) -> torch.UntypedStorage | torch.TypedStorage:
    return _unwrap(cls, _STORAGE_TYPES)()


def _rebuild_cuda_tensor(budget: _Budget, *args: Any) -> torch.Tensor:
    """torch's CUDA IPC rebuild, with the device given by UUID (or index) mapped to this process's index; the
    tensor must lie inside the storage the handle declares."""
    if len(args) != 15:
        raise pickle.UnpicklingError(f"a CUDA tensor handle has 15 fields, got {len(args)}")
    args_list = list(args)
    args_list[0], args_list[4] = _unwrap(args[0], _TENSOR_TYPES), _unwrap(args[4], _STORAGE_TYPES)
    size, stride, offset, dtype, storage_bytes = args[1], args[2], args[3], args[5], args[8]
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a dtype: {dtype!r}")
    budget.storage(storage_bytes)
    _check_view(budget, storage_bytes, dtype.itemsize, offset, size, stride)
    device = args_list[CUDA_DEVICE_ARG]
    if isinstance(device, str):
        matches = [
            i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise ValueError(f"Invalid device_uuid={device}")
        args_list[CUDA_DEVICE_ARG] = matches[0]
    return reductions.rebuild_cuda_tensor(*args_list)


def _load_storage_bytes(budget: _Budget, data: Any) -> torch.TypedStorage | torch.UntypedStorage:
    """A storage pickled by value (plain `pickle`, its bytes in the request body), loaded without running
    arbitrary code."""
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError("a storage by value is bytes")
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    untyped = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
    budget.storage(untyped.nbytes())
    return storage


def _bytes(*args: Any) -> bytes:
    """`bytes(...)` without the size form (`bytes(n)` allocates n bytes)."""
    if args and isinstance(args[0], int):
        raise pickle.UnpicklingError("bytes(n) is not allowed in a weight payload")
    return bytes(*args)


def _encode(text: Any, encoding: Any = "latin1", errors: Any = "strict") -> bytes:
    """How protocol-2 pickles write bytes: `_codecs.encode(str, "latin1")`, nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError("_codecs.encode only re-encodes latin-1 text")
    return codecs.encode(text, "latin1")


_TENSOR_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)
_STORAGE_TYPES: tuple[type, ...] = (torch.UntypedStorage, torch.TypedStorage)
SHM_HANDLE = re.compile(rb"/torch_\d+_\d+_\d+")
DEFAULT_MAX_BYTES = 1 << 30  # what a payload may make the engine hold when the caller sets no bound
_BUILTINS = ("bool", "complex", "dict", "float", "frozenset", "int", "list", "set", "slice", "str", "tuple")
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# (module, name) -> what it resolves to: the part of SGLang 0.5.23's allow-list that weight payloads use, each
# constructor that could allocate replaced by a checked one (`bytearray`, `range` and sized constructors refused).
ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", n): getattr(builtins, n) for n in _BUILTINS},
    **{("torch", n): d for n, d in _DTYPES.items()},
    ("builtins", "bytes"): _bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("copyreg", "__newobj__"): copyreg.__newobj__,  # type: ignore[attr-defined]
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("_codecs", "encode"): _encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "dtype"): torch.dtype,
    ("torch", "Tensor"): _ClassRef(torch.Tensor),
    ("torch", "UntypedStorage"): _ClassRef(torch.UntypedStorage),
    ("torch.nn.parameter", "Parameter"): _ClassRef(torch.nn.Parameter),
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "UntypedStorage"): _ClassRef(torch.UntypedStorage),
    ("torch.storage", "TypedStorage"): _ClassRef(torch.TypedStorage),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}
# Rebuilds that draw on the payload's byte budget (bound to it per payload).
METERED: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _mp_rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
}


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals a weight payload needs (a subset of what SGLang 0.5.23 allows), and rebuilds
    tensors only inside their storage, within `max_bytes`."""

    def __init__(self, file: io.BytesIO, max_bytes: int = DEFAULT_MAX_BYTES, segments: Segments | None = None) -> None:
        super().__init__(file)
        self.budget = _Budget(max_bytes, segments)
        self._bound: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in METERED:
            if key not in self._bound:
                self._bound[key] = bound = functools.partial(METERED[key], self.budget)
                if name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
                    self.budget.tensor_rebuilds.append(bound)
            return self._bound[key]
        found = ALLOWED.get(key)
        if found is None:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return found


def deserialize(payload: str | bytes, max_bytes: int = DEFAULT_MAX_BYTES, segments: Segments | None = None) -> Any:
    """One rank's payload (base64 text, or the raw pickle) -> the object it holds, tensors mapped in place (and
    the sender's persistent memory kept in `segments`)."""
    data = payload.encode() if isinstance(payload, str) else bytes(payload)
    if not (len(data) >= 2 and data[0] == 0x80):
        data = base64.b64decode(data, validate=True)
    return SafeUnpickler(io.BytesIO(data), max_bytes, segments).load()


def decode_payload(
    payloads: Sequence[str | bytes],
    load_format: str | None,
    rank: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    segments: Segments | None = None,
) -> list[tuple[str, Any]]:
    """TP rank `rank`'s (name, tensor) pairs of an `/update_weights_from_tensor` request (entries of other ranks
    are not read: reading one maps its memory); its tensors hold at most `max_bytes` together."""
    if load_format not in LOAD_FORMATS:
        raise NotImplementedError(f"Unknown load_format={load_format}")
    if rank >= len(payloads):
        raise IndexError(f"no payload for TP rank {rank} ({len(payloads)} given)")
    obj = deserialize(payloads[rank], max_bytes, segments)
    if load_format == "flattened_bucket":
        return _flattened_tensors(obj)
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError("the payload of load_format null or direct is a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]


def _flattened_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a `flattened_bucket` payload, rebuilt from its metadata as SGLang does."""
    if not isinstance(obj, dict) or not isinstance(obj.get("flattened_tensor"), torch.Tensor):
        raise ValueError("a flattened_bucket payload is a dict with a flattened_tensor and its metadata")
    flat = obj["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]


def is_base64(text: str) -> bool:
    """Whether `text` decodes as strict base64 (SGLang's request validation refuses other payload strings)."""
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
