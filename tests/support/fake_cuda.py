"""A CUDA device on a CPU-only machine, for tests: code runs on the CPU, but tensors remember which device they
would live on, and CUDA's rules for mixing devices are enforced.

On a CPU-only machine the engine's device and the default device are the same, so a tensor created without
`device=` next to CUDA logits goes unnoticed until the code meets a GPU. `FakeCuda` tells them apart: while it
is active (on every thread that enters it), a tensor is on the fake `cuda:0` when its storage was created there
(a factory given `device="cuda"`, `.to("cuda")`, `.cuda()`, or an op on such tensors) and on the host otherwise,
as on a real machine. `tensor.device` reports `cuda:0` for the former, so code that follows its inputs' device
keeps working. It refuses, with CUDA's messages:

- an op mixing host and device tensors (a host tensor of zero dimensions is allowed, as on CUDA); advanced
  indexing of a device tensor may use host indices, and `copy_` and `.to` cross devices, as on CUDA;
- a random op whose generator is on another device than its tensors (`torch.Generator` is replaced while
  active by a subclass that remembers the device it was asked for);
- `.numpy()` of a device tensor.

It models device placement only: no streams, no asynchronous errors, no memory accounting. Code that branches
on `device.type == "cuda"` takes its CUDA branch while running on the CPU: fine for transformers' dense models,
not for its mixture-of-experts kernels (a CUDA-only `histc` on integers).
"""

from types import TracebackType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

CUDA = torch.device("cuda", 0)
HOST = torch.device("cpu")
_REAL_GENERATOR = torch.Generator
_DEVICE = torch.Tensor.device
_IS_CUDA = torch.Tensor.is_cuda
_IS_CPU = torch.Tensor.is_cpu
_INDEXING = ("__getitem__", "__setitem__", "index_put_", "index_put")
_METADATA = ("_has_compatible_shallow_copy_type",)


class FakeGenerator(_REAL_GENERATOR):
    """A CPU generator that remembers the device it was created for (`logical_device`)."""

    logical_device: torch.device

    def __new__(cls, device: Any = None) -> "FakeGenerator":
        generator = super().__new__(cls, "cpu")
        generator.logical_device = _device_of(device) if device is not None else HOST
        return generator

    def __init__(self, device: Any = None) -> None:
        pass


def _device_of(value: Any) -> torch.device:
    device = torch.device(value) if not isinstance(value, int) else torch.device("cuda", value)
    return CUDA if device.type == "cuda" else device


class FakeCuda(TorchFunctionMode):
    """The mode; `with FakeCuda() as cuda:` activates it on this thread, `cuda.enter()` / `cuda.exit()` on
    another thread (e.g. through `Scheduler.call`). Every thread shares its record of device storages."""

    def __init__(self) -> None:
        super().__init__()
        self._on_device: dict[int, StorageWeakRef] = {}
        self._threads = 0

    # ---- activation ----

    def __enter__(self) -> "FakeCuda":
        self.enter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.exit()

    def enter(self) -> None:
        """Activate on the calling thread (and replace `torch.Generator` while any thread has it active)."""
        if self._threads == 0:
            torch.Generator = FakeGenerator  # type: ignore[misc]
        self._threads += 1
        super().__enter__()

    def exit(self) -> None:
        super().__exit__(None, None, None)
        self._threads -= 1
        if self._threads == 0:
            torch.Generator = _REAL_GENERATOR  # type: ignore[misc]

    # ---- where tensors live ----

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage was created on the fake CUDA device."""
        storage = tensor.untyped_storage()
        ref = self._on_device.get(storage._cdata)
        return ref is not None and not ref.expired()

    def _mark(self, value: Any) -> None:
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self._on_device[storage._cdata] = StorageWeakRef(storage)

    def _where(self, tensor: torch.Tensor) -> torch.device:
        return CUDA if self.is_on_device(tensor) else tensor.device

    # ---- the rules ----

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:
            return self._where(args[0])
        if owner is _IS_CUDA:
            return self.is_on_device(args[0])
        if owner is _IS_CPU:
            return not self.is_on_device(args[0]) and args[0].is_cpu
        if isinstance(owner, type(_DEVICE)) or getattr(func, "__name__", "") in _METADATA:
            return func(*args, **(kwargs or {}))  # other attributes (`.data`, `.shape`, ...) and metadata checks
        name = getattr(func, "__name__", "")
        is_method = isinstance(args[0], torch.Tensor) if args else False
        if is_method and name in ("to", "cuda", "cpu"):
            return self._transfer(func, name, args, kwargs)
        if is_method and name == "copy_":
            return func(*args, **kwargs)
        if is_method and name == "numpy" and self.is_on_device(args[0]):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
                "memory first."
            )
        if name == "get_device" and is_method:
            return 0 if self.is_on_device(args[0]) else -1

        target = None
        if kwargs.get("device") is not None:
            target = _device_of(kwargs["device"])
            if target == CUDA:
                kwargs["device"] = HOST
        if target is not None:  # a factory: tensors among its arguments are data or templates, on any device
            where = target
        elif name in _INDEXING and is_method:
            where = self._check_indexing(name, args)
        else:
            where = self._check_same_device(name, args, kwargs)
        generator = kwargs.get("generator")
        if isinstance(generator, torch._C.Generator):
            found = getattr(generator, "logical_device", HOST)
            if found.type != where.type:
                raise RuntimeError(f"Expected a '{where.type}' device type for generator but found '{found.type}'")
        out = func(*args, **kwargs)
        if where == CUDA:
            self._mark(out)
        return out

    def _check_same_device(self, name: str, args: tuple, kwargs: dict) -> torch.device:
        """The device an op runs on; raises as CUDA does when its tensors are on different devices."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {self._where(t) for t in tensors if t.dim() > 0 or self.is_on_device(t)}
        if len(devices) > 1:
            first, second = sorted(devices, key=str, reverse=True)[:2]
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {first} and "
                f"{second}! ({name})"
            )
        if devices:
            return devices.pop()
        return HOST if not tensors else self._where(tensors[0])

    def _check_indexing(self, name: str, args: tuple) -> torch.device:
        """Advanced indexing of a device tensor accepts host indices; values set through advanced indices must
        be on the device (or zero-dimensional); basic indexing copies values across devices."""
        base, index = args[0], args[1]
        where = self._where(base)
        index_tensors = [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)]
        advanced = (
            bool(index_tensors)
            or isinstance(index, list)
            or any(isinstance(i, list) for i in (index if isinstance(index, tuple) else ()))
        )
        for t in index_tensors:
            if self._where(t) not in (where, HOST):
                raise RuntimeError(
                    f"indices should be either on cpu or on the same device as the indexed tensor ({where})"
                )
        if len(args) > 2 and advanced:
            value = args[2]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and self._where(value) != where:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"{where} and {self._where(value)}! ({name})"
                )
        return where

    def _transfer(self, func: Any, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """`.to`, `.cuda()`, `.cpu()`: a copy whenever the (fake) device changes, as on a real machine."""
        tensor, source = args[0], self._where(args[0])
        device = CUDA if name == "cuda" else HOST if name == "cpu" else kwargs.get("device")
        dtype = kwargs.get("dtype")
        for arg in args[1:] if name == "to" else ():
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, torch.Tensor):
                device, dtype = self._where(arg), arg.dtype
            elif arg is not None and not isinstance(arg, bool):
                device = arg
        non_blocking = bool(kwargs.get("non_blocking", False))
        bools = [a for a in args[1:] if isinstance(a, bool)] if name == "to" else []
        if bools:
            non_blocking = bools[0]
        copy = bool(kwargs.get("copy", False)) or (len(bools) > 1 and bools[1])
        target = _device_of(device) if device is not None else source
        out = torch.Tensor.to(
            tensor,
            device=HOST if target == CUDA else target,
            dtype=dtype if dtype is not None else tensor.dtype,
            non_blocking=non_blocking,
            copy=copy or target != source,
            memory_format=kwargs.get("memory_format", torch.preserve_format),
        )
        if target == CUDA:
            self._mark(out)
        return out
