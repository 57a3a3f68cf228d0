"""The payload format of SGLang's `/update_weights_from_tensor`: tensors that travel as handles, not bytes.

A payload is a `multiprocessing` ForkingPickler pickle (SGLang's `MultiprocessingSerializer`), base64 in the
JSON body, one per engine TP rank. Tensors inside it are references to memory the sender keeps alive until the
engine answers:
- CUDA tensors: CUDA IPC handles (torch's reduction) with the device given by its UUID instead of its index, as
  SGLang's patched reduction sends it: the trainer and the engine see different `CUDA_VISIBLE_DEVICES`;
- CPU tensors: the name of a shared-memory file (torch's `file_system` sharing strategy, whatever the process's
  strategy is): an unrelated process (the engine server) can map it, where a file descriptor could only be
  passed to a child process.

`load_format: "flattened_bucket"` payloads hold `{"flattened_tensor": uint8 tensor, "metadata": [...]}`, each
metadata entry with the attributes of SGLang's `FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx,
numel). The sender writes them as `types.SimpleNamespace` (SGLang's unpickler allows it; the trainer has no
SGLang to import its class from); the receiver takes either.

Receiving (the embedded server) follows SGLang 0.5.23's `SafeUnpickler`: only the globals such a payload needs
are resolved; anything else is refused with SGLang's message.
"""

import base64
import binascii
import builtins
import codecs
import collections
import copyreg
import io
import pickle
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from userrl_megatron.sync.bucket import BucketEntry

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


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's CUDA IPC rebuild, with the device given by UUID (or index) mapped to this process's index."""
    args_list = list(args)
    device = args_list[CUDA_DEVICE_ARG]
    if isinstance(device, str):
        matches = [
            i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise ValueError(f"Invalid device_uuid={device}")
        args_list[CUDA_DEVICE_ARG] = matches[0]
    return reductions.rebuild_cuda_tensor(*args_list)


def _load_storage_bytes(data: bytes) -> torch.UntypedStorage:
    """A storage pickled by value (plain `pickle`), loaded without running arbitrary code."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


_BUILTINS = ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range", "set")
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# (module, name) -> what it resolves to: the part of SGLang 0.5.23's allow-list that weight payloads use.
ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", n): getattr(builtins, n) for n in (*_BUILTINS, "slice", "str", "tuple")},
    **{("torch", n): d for n, d in _DTYPES.items()},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("copyreg", "__newobj__"): copyreg.__newobj__,  # type: ignore[attr-defined]
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("_codecs", "encode"): codecs.encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "dtype"): torch.dtype,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): torch._tensor._rebuild_from_type_v2,
    ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals a weight payload needs (a subset of what SGLang 0.5.23 allows)."""

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return found


def deserialize(payload: str | bytes) -> Any:
    """One rank's payload (base64 text, or the raw pickle) -> the object it holds, tensors mapped in place."""
    data = payload.encode() if isinstance(payload, str) else bytes(payload)
    if not (len(data) >= 2 and data[0] == 0x80):
        data = base64.b64decode(data, validate=True)
    return SafeUnpickler(io.BytesIO(data)).load()


def decode_payload(payloads: Sequence[str | bytes], load_format: str | None, rank: int = 0) -> list[tuple[str, Any]]:
    """TP rank `rank`'s (name, tensor) pairs of an `/update_weights_from_tensor` request (entries of other ranks
    are not read: reading one maps its memory)."""
    if load_format not in LOAD_FORMATS:
        raise NotImplementedError(f"Unknown load_format={load_format}")
    if rank >= len(payloads):
        raise IndexError(f"no payload for TP rank {rank} ({len(payloads)} given)")
    obj = deserialize(payloads[rank])
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
