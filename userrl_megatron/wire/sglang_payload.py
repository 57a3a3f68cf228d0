"""SGLang's payload format for `/update_weights_from_tensor`: what the senders write to SGLang, and a bounded
reader of it that the embedded engine uses only when started with `--accept-pickle-payloads` (the conformance
suite decodes a payload SGLang's own classes wrote).

A payload is a `multiprocessing` ForkingPickler pickle (SGLang's `MultiprocessingSerializer`), base64 in the JSON
body, one per engine TP rank, whose tensors are handles (`handles.py`): CPU storages by shared-memory file name,
CUDA tensors by IPC handle with the device's UUID. `load_format: "flattened_bucket"` payloads hold
`{"flattened_tensor": uint8 tensor, "metadata": [...]}`, each metadata entry with the attributes of SGLang's
`FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx, numel). The sender writes them as
`types.SimpleNamespace` (SGLang's unpickler allows it; the trainer has no SGLang to import its class from); the
reader takes either.

The reader resolves only globals of SGLang 0.5.23's allow-list that such payloads use, and reads only the opcode
shapes torch's and SGLang's reductions write:
- binary data, tuples, lists, dicts, the memo, globals, REDUCE, NEWOBJ and BUILD; no sets, text opcodes,
  extensions, persistent ids or out-of-band buffers;
- BUILD only on metadata objects, with a dict of str keys (`Tensor.__setstate__` would `set_` a tensor to a
  larger shape, growing its storage with uninitialised memory); NEWOBJ only of metadata classes; REDUCE only of
  a resolved global;
- containers nest at most MAX_DEPTH deep (a shared reference counts at each place), dict keys are scalars, the
  memo holds at most MAX_MEMO objects and a payload runs at most MAX_OPS opcodes (a deep or shared tuple used
  as a key made `hash()` overflow the stack or take 2^depth steps);
- a tensor is rebuilt only inside its storage; the tensors of a payload hold at most `max_bytes` together, and
  so do its storages;
- a shared-memory file is named only as torch names it and checked (owner, real size) before torch maps it;
- a storage by value is read only in the format pickling a storage writes (torch's legacy format), its size
  checked before anything is allocated; never through `torch.load`, whose zip archives inflate compressed
  records before any size is known;
- tensor and storage classes are arguments never called (`torch.Tensor(n)` allocates); `bytearray`, `range`,
  `bytes(n)`, sets and dict constructors are refused.
"""

import base64
import codecs
import collections
import functools
import io
import math
import pickle
import pickletools
import re
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from userrl_megatron.wire.bucket import BucketEntry
from userrl_megatron.wire.handles import (
    SHM_HANDLE,
    check_ref_counter,
    check_shm,
    device_index,
    device_uuid,
    through_shm_manager,
)

CUDA_DEVICE_ARG = 6  # position of the device index in the arguments of torch's `rebuild_cuda_tensor`
DEFAULT_MAX_BYTES = 1 << 30  # what a payload may make the engine hold when the caller sets no bound
MAX_DEPTH = 16  # containers nested in a payload (torch's and SGLang's nest 7 deep)
MAX_MEMO = 1 << 20  # objects in a payload's pickle memo
MAX_OPS = 1 << 22  # opcodes a payload runs (a tensor costs about 30)
MAX_HANDLE_BYTES = 4096  # a CUDA IPC or event handle (64 bytes from torch)
_OPCODE_NAMES = {op.code: op.name for op in pickletools.opcodes}


# ---- writing (the trainer, to SGLang) ----


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
        args[CUDA_DEVICE_ARG] = device_uuid(args[CUDA_DEVICE_ARG])
        args = tuple(args)
    return rebuild, args


def serialize(obj: Any) -> str:
    """A base64 ForkingPickler payload of `obj` in which tensors are handles.

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


# ---- reading (the embedded engine, when it accepts pickles) ----


@dataclass
class FlattenedTensorMetadata:
    """Stands in for SGLang's class of that name when a payload written with SGLang installed names it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_STATE_CLASSES: tuple[type, ...] = (types.SimpleNamespace, FlattenedTensorMetadata)  # what NEWOBJ and BUILD make
_KEY_TYPES: tuple[type, ...] = (str, bytes, int, float, bool, type(None))  # dict keys hashed in bounded time
_TENSOR_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)
_STORAGE_TYPES: tuple[type, ...] = (torch.UntypedStorage, torch.TypedStorage)
SHM_MANAGER = re.compile(rb"(/[\w.-]+)*/torch-shm-dir-\w+/manager\.sock")  # torch's shared-memory manager socket


def _show(value: Any) -> str:
    """A payload value in a message: short, and never the repr of a container (a shared tuple's is exponential)."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, (str, bytes)):
        return repr(value[:80])
    if isinstance(value, (tuple, list)) and len(value) <= 8 and all(type(v) is int for v in value):
        return repr(value)
    return f"a {type(value).__name__}"


class _Budget:
    """What one payload may make the engine hold: tensors of `max_bytes` together, and storages of as much."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.tensors, self.storages = max_bytes, 0, 0
        self.tensor_rebuilds: list[Any] = []  # this payload's bound tensor rebuilds (_rebuild_from_type_v2 calls)

    def storage(self, nbytes: Any) -> None:
        if type(nbytes) is not int or not 0 <= nbytes <= self.max_bytes:
            raise pickle.UnpicklingError(f"a storage of {_show(nbytes)} bytes (at most {self.max_bytes})")
        self.storages += nbytes
        if self.storages > self.max_bytes:
            raise pickle.UnpicklingError(f"the payload's storages exceed {self.max_bytes} bytes")

    def tensor(self, nbytes: int) -> None:
        self.tensors += nbytes
        if self.tensors > self.max_bytes:
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
        raise pickle.UnpicklingError(f"expected one of {', '.join(c.__name__ for c in allowed)}, got {_show(ref)}")
    return ref.cls


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError(f"{what} must be a sequence of non-negative integers, got {_show(value)}")
    return tuple(value)


def _check_view(budget: _Budget, nbytes: int, itemsize: int, offset: Any, size: Any, stride: Any) -> None:
    """A tensor of `size`/`stride` at element `offset` reads only its storage's `nbytes` and is no larger than
    it (torch would grow the storage with uninitialised memory; an overlapping view could be huge)."""
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride):
        raise pickle.UnpicklingError(f"a bad tensor view: offset {_show(offset)}, size {size}, stride {stride}")
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
    if hooks or any(m is not None for m in meta):
        raise pickle.UnpicklingError("a tensor with backward hooks or metadata")
    typed = _fitted(budget, storage, offset, size, stride)
    return torch._utils._rebuild_tensor_v2(typed, offset, size, stride, bool(requires_grad), collections.OrderedDict())


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.nn.Parameter:
    if not isinstance(data, torch.Tensor) or hooks:
        raise pickle.UnpicklingError("a parameter is rebuilt from a tensor, without backward hooks")
    return torch._utils._rebuild_parameter(data, bool(requires_grad), collections.OrderedDict())


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
    """A shared-memory file of torch's naming (`/torch_<pid>_<n>_<n>`) of at most the budget's bytes, which holds
    them (torch would grow it), registered with a manager socket of torch's naming."""
    cls = _unwrap(cls, _STORAGE_TYPES)
    if not isinstance(handle, bytes) or not SHM_HANDLE.fullmatch(handle):
        raise pickle.UnpicklingError(f"not a torch shared-memory file name: {_show(handle)}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a dtype: {_show(dtype)}")
    nbytes = size if dtype is None or type(size) is not int else size * dtype.itemsize
    budget.storage(nbytes)
    if not isinstance(manager, bytes) or not SHM_MANAGER.fullmatch(manager) or b"/../" in manager:
        raise pickle.UnpicklingError(f"not torch's shared-memory manager socket: {_show(manager)}")
    check_shm(handle, nbytes)
    return through_shm_manager(lambda: reductions.rebuild_storage_filename(cls, manager, handle, size, dtype))


def _rebuild_storage_empty(cls: Any) -> torch.UntypedStorage | torch.TypedStorage:
    return _unwrap(cls, _STORAGE_TYPES)()


def _rebuild_cuda_tensor(budget: _Budget, *args: Any) -> torch.Tensor:
    """torch's CUDA IPC rebuild, with the device given by UUID (or index) mapped to this process's index; the
    tensor must lie inside the storage the handle declares, and the reference counter it names must be one."""
    if len(args) != 15:
        raise pickle.UnpicklingError(f"a CUDA tensor handle has 15 fields, got {len(args)}")
    args_list = list(args)
    args_list[0], args_list[4] = _unwrap(args[0], _TENSOR_TYPES), _unwrap(args[4], _STORAGE_TYPES)
    size, stride, offset, dtype, storage_bytes = args[1], args[2], args[3], args[5], args[8]
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a dtype: {_show(dtype)}")
    budget.storage(storage_bytes)
    _check_view(budget, storage_bytes, dtype.itemsize, offset, size, stride)
    handles = (args[7], args[11], args[13])  # the memory, its reference counter file, its event
    if not all(isinstance(h, bytes) and len(h) <= MAX_HANDLE_BYTES for h in handles):
        raise pickle.UnpicklingError("a CUDA IPC handle is bytes")
    if storage_bytes:
        check_ref_counter(args[11], args[12])
    device = args_list[CUDA_DEVICE_ARG]
    args_list[CUDA_DEVICE_ARG] = device_index(device) if isinstance(device, str) else device
    args_list[10] = bool(args[10])
    return reductions.rebuild_cuda_tensor(*args_list)


# torch's legacy serialization, as pickling a storage writes it (`TypedStorage.__reduce__`)
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_LEGACY_STORAGES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


@dataclass(frozen=True)
class _StorageType:
    """A legacy storage class named in a storage's persistent id (never constructed)."""

    dtype: torch.dtype


def _load_storage_bytes(budget: _Budget, data: Any) -> torch.TypedStorage:
    """A storage pickled by value: the bytes `TypedStorage.__reduce__` writes (torch's legacy format: its magic
    number, protocol, system info, the storage's persistent id, its key, then its element count and raw bytes),
    read field by field with this module's unpickler; the size is checked before anything is allocated."""
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError("a storage by value is bytes")
    if data[:4] == b"PK\x03\x04":
        raise pickle.UnpicklingError(
            "a storage by value in a zip archive is refused (its records may be compressed): pickling a storage "
            "writes torch's legacy format"
        )
    f = io.BytesIO(data)
    if _small(f) != LEGACY_MAGIC or _small(f) != LEGACY_PROTOCOL:
        raise pickle.UnpicklingError("a storage by value is in torch's legacy format")
    info = _small(f)
    if not isinstance(info, dict) or info.get("little_endian") is not True or sys.byteorder != "little":
        raise pickle.UnpicklingError("a storage by value is little-endian")
    record = _LegacyStorageUnpickler(f).load()
    keys = _small(f)
    if not isinstance(record, tuple) or len(record) != 3 or keys != [record[1]]:
        raise pickle.UnpicklingError("a storage by value holds one storage")
    dtype, _, numel = record
    budget.storage(numel * dtype.itemsize)
    if int.from_bytes(f.read(8), "little") != numel or len(data) - f.tell() != numel * dtype.itemsize:
        raise pickle.UnpicklingError(f"a storage by value of {numel} elements holds other bytes")
    raw = torch.frombuffer(bytearray(memoryview(data)[f.tell() :]), dtype=torch.uint8) if numel else None
    untyped = raw.untyped_storage() if raw is not None else torch.UntypedStorage(0)
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _small(f: io.BytesIO) -> Any:
    """One of the plain-data pickles around a legacy storage (no globals)."""
    return PayloadUnpickler(f, 0).load()


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


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    """An empty OrderedDict (a tensor's backward hooks); filled, it would hash keys of the payload's choice."""
    if args:
        raise pickle.UnpicklingError("an OrderedDict in a weight payload is empty")
    return collections.OrderedDict()


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# (module, name) -> what it resolves to: the part of SGLang 0.5.23's allow-list that weight payloads use, each
# constructor that could allocate or hash replaced by a checked one or left out.
ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch", n): d for n, d in _DTYPES.items()},
    ("builtins", "bytes"): _bytes,
    ("collections", "OrderedDict"): _ordered_dict,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("_codecs", "encode"): _encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
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


class PayloadUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with an opcode allow-list (module docstring): globals from ALLOWED and METERED
    (the latter bound to this payload's budget of `max_bytes`), containers tracked for their depth."""

    ops: dict[int, Callable[["PayloadUnpickler"], None]]  # the opcodes it runs (set below `_OPS`)
    memo: dict[int, Any]
    pop_mark: Callable[[], list[Any]]

    def __init__(self, file: io.BytesIO, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(file)
        self.budget = _Budget(max_bytes)
        self._bound: dict[tuple[str, str], Any] = {}
        self._resolved: list[Any] = []  # what find_class returned: REDUCE calls only these
        self._depth: dict[int, int] = {}  # id -> nesting depth of the containers made so far
        self._made: list[Any] = []  # ... kept alive while loading, so that no id is reused

    def load(self) -> Any:
        """`pickle._Unpickler.load`, running only the opcodes of `ops`, at most MAX_OPS of them."""
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        for _ in range(MAX_OPS):
            key = self.read(1)
            if not key:
                raise pickle.UnpicklingError("the pickle ends before its STOP")
            op = self.ops.get(key[0])
            if op is None:
                name = _OPCODE_NAMES.get(chr(key[0]), repr(key))
                raise pickle.UnpicklingError(f"pickle opcode {name} is not allowed in a weight payload")
            try:
                op(self)
            except pickle._Stop as stop:  # type: ignore[attr-defined]
                return stop.value
        raise pickle.UnpicklingError(f"a weight payload runs at most {MAX_OPS} pickle opcodes")

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in METERED:
            if key not in self._bound:
                self._bound[key] = bound = functools.partial(METERED[key], self.budget)
                if name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
                    self.budget.tensor_rebuilds.append(bound)
            found = self._bound[key]
        else:
            found = ALLOWED.get(key)
            if found is None:
                raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if not any(found is r for r in self._resolved):
            self._resolved.append(found)
        return found

    def _depth_of(self, obj: Any) -> int:
        return self._depth.get(id(obj), 0)

    def _note(self, obj: Any, depth: int) -> None:
        """Record the nesting depth of container `obj` (refused past MAX_DEPTH)."""
        if depth > MAX_DEPTH:
            raise pickle.UnpicklingError(f"containers nested deeper than {MAX_DEPTH} levels in a weight payload")
        if id(obj) not in self._depth:
            self._made.append(obj)
        self._depth[id(obj)] = max(depth, self._depth_of(obj))

    def _new_container(self, code: bytes) -> None:
        _BASE[code[0]](self)
        top = self.stack[-1]
        self._note(top, 1 + max((self._depth_of(x) for x in top), default=0) if type(top) is tuple else 1)

    def _memoize(self, code: bytes) -> None:
        if len(self.memo) >= MAX_MEMO:
            raise pickle.UnpicklingError(f"the pickle memo of a weight payload holds at most {MAX_MEMO} objects")
        _BASE[code[0]](self)

    def _append(self) -> None:
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def _appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            raise pickle.UnpicklingError(f"APPEND to a {type(target).__name__} is not allowed in a weight payload")
        self._note(target, 1 + max((self._depth_of(x) for x in items), default=0))
        target.extend(items)

    def _setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._set(self.stack[-1], [key, value])

    def _setitems(self) -> None:
        items = self.pop_mark()
        self._set(self.stack[-1], items)

    def _set(self, target: Any, items: list[Any]) -> None:
        if type(target) is not dict:
            raise pickle.UnpicklingError(f"SETITEM on a {type(target).__name__} is not allowed in a weight payload")
        keys, values = items[::2], items[1::2]
        if len(keys) != len(values) or not all(type(k) in _KEY_TYPES for k in keys):
            raise pickle.UnpicklingError("dict keys in a weight payload are str, bytes, numbers or None")
        self._note(target, 1 + max((self._depth_of(v) for v in values), default=0))
        target.update(zip(keys, values, strict=True))

    def _reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is r for r in self._resolved) or type(args) is not tuple:
            raise pickle.UnpicklingError("REDUCE calls only a global of the payload with a tuple of arguments")
        result = func(*args)
        self.stack[-1] = result
        if isinstance(result, (tuple, list, dict)):
            self._note(result, 1 + self._depth_of(args))

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in _STATE_CLASSES) or type(args) is not tuple or args:
            raise pickle.UnpicklingError(f"NEWOBJ makes only tensor metadata, not {_show(cls)}")
        self.append(cls.__new__(cls))

    def _build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in _STATE_CLASSES:
            raise pickle.UnpicklingError(
                f"BUILD on a {type(inst).__name__} is not allowed in a weight payload (only tensor metadata takes "
                "state: Tensor.__setstate__ would resize a tensor over memory it does not own)"
            )
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise pickle.UnpicklingError("the state of tensor metadata is a dict of str keys")
        vars(inst).update(state)
        self._note(inst, 1 + self._depth_of(state))


class _LegacyStorageUnpickler(PayloadUnpickler):
    """The persistent-id pickle of one legacy storage: `('storage', <dtype>Storage, key, 'cpu', numel, None)`."""

    def find_class(self, module: str, name: str) -> Any:
        if module != "torch" or name not in _LEGACY_STORAGES:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return _StorageType(_LEGACY_STORAGES[name])

    def persistent_load(self, pid: Any) -> Any:
        if (
            type(pid) is not tuple
            or len(pid) != 6
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or type(pid[2]) is not str
            or pid[3] != "cpu"
            or type(pid[4]) is not int
            or pid[4] < 0
            or pid[5] is not None
        ):
            raise pickle.UnpicklingError("a storage by value names one CPU storage")
        return pid[1].dtype, pid[2], pid[4]


_BASE: dict[int, Callable[[Any], None]] = pickle._Unpickler.dispatch
_PLAIN = (  # opcodes that push data or look it up: nothing runs, nothing grows beyond what the payload holds
    pickle.PROTO,
    pickle.FRAME,
    pickle.STOP,
    pickle.MARK,
    pickle.NONE,
    pickle.NEWTRUE,
    pickle.NEWFALSE,
    pickle.BININT,
    pickle.BININT1,
    pickle.BININT2,
    pickle.LONG1,
    pickle.BINFLOAT,
    pickle.SHORT_BINUNICODE,
    pickle.BINUNICODE,
    pickle.SHORT_BINBYTES,
    pickle.BINBYTES,
    pickle.BINGET,
    pickle.LONG_BINGET,
    pickle.GLOBAL,
    pickle.STACK_GLOBAL,
)
_OPS: dict[int, Callable[[PayloadUnpickler], None]] = {
    **{code[0]: _BASE[code[0]] for code in _PLAIN},
    **{
        code[0]: functools.partial(lambda code, self: self._memoize(code), code)
        for code in (pickle.MEMOIZE, pickle.BINPUT, pickle.LONG_BINPUT)
    },
    **{
        code[0]: functools.partial(lambda code, self: self._new_container(code), code)
        for code in (
            pickle.EMPTY_TUPLE,
            pickle.TUPLE,
            pickle.TUPLE1,
            pickle.TUPLE2,
            pickle.TUPLE3,
            pickle.EMPTY_LIST,
            pickle.EMPTY_DICT,
        )
    },
    pickle.APPEND[0]: PayloadUnpickler._append,
    pickle.APPENDS[0]: PayloadUnpickler._appends,
    pickle.SETITEM[0]: PayloadUnpickler._setitem,
    pickle.SETITEMS[0]: PayloadUnpickler._setitems,
    pickle.REDUCE[0]: PayloadUnpickler._reduce,
    pickle.NEWOBJ[0]: PayloadUnpickler._newobj,
    pickle.BUILD[0]: PayloadUnpickler._build,
}


PayloadUnpickler.ops = _OPS
_LegacyStorageUnpickler.ops = {**_OPS, pickle.BINPERSID[0]: _BASE[pickle.BINPERSID[0]]}  # its storage record only


def read_pickle(data: bytes, load_format: str | None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, Any]]:
    """The (name, tensor) pairs of one rank's pickle payload (raw bytes), tensors mapped in place; they and their
    storages hold at most `max_bytes` each together."""
    obj = PayloadUnpickler(io.BytesIO(data), max_bytes).load()
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
    metadata = obj.get("metadata")
    if not isinstance(metadata, list) or not all(isinstance(m, _STATE_CLASSES) for m in metadata):
        raise ValueError("a flattened_bucket payload's metadata is a list of FlattenedTensorMetadata")
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
