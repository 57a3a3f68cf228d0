"""Run Megatron-core on CPU with gloo: the few places where it assumes CUDA, redirected to the CPU.

Used only when CUDA is absent (CI, laptops). `install()` (called by `parallel.initialize`) must run before
Megatron code runs in a process. A process that only unpickles tensors pickled by a Megatron process (a Ray
driver) needs `import megatron.core` to work, because that import replaces torch's storage unpickler with one
living in `megatron.core.safe_globals`; megatron-core 0.19 cannot be imported without triton (one MoE kernel
module imports it at top level), so such a process calls `stub_missing_kernels()` first: it stubs that module.

What it does, and why each part is needed:
  * stubs `megatron.core.transformer.moe.ops.paged_stash` when triton is missing (MoE paged-stash kernels);
  * `torch.cuda.current_device/set_device/synchronize`, streams and events become no-ops (DDP, the
    optimizer, the pipeline schedules and rope call them);
  * the CUDA RNG (and Megatron's model-parallel RNG tracker) uses the CPU generator;
  * the MoE all-to-all token dispatcher's split sizes become numpy arrays as on GPU (Megatron converts them
    only when they sit on a CUDA device; torch's all_to_all_single refuses tensors as split sizes), and the
    backward of its all-to-all runs under `CudaToCpuMode` (the autograd engine runs it outside the mode, and
    it allocates on `torch.cuda.current_device()`);
  * `CudaToCpuMode` maps `device="cuda"` / integer devices to the CPU and makes CPU tensors report
    `torch.cuda.*` types, which Megatron's optimizers and gradient clipping assert on.

The mode is a torch function mode, which is thread-local: `install()` enters it on the calling thread and
`enter_mode()` enters it on any other thread that runs Megatron code (Ray may call actor methods from a
thread other than the one that built the actor).
"""

import contextlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"

_installed = False
_thread_state = threading.local()


class _Stream:
    """Stands in for torch.cuda.Stream: on the CPU every operation has completed when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: "_Event | None" = None) -> "_Event":
        return event or _Event()

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


class _Event(_Stream):
    """Stands in for torch.cuda.Event."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def elapsed_time(self, other: "_Event") -> float:
        return 0.0


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # an integer device means cuda:<n>
        return "cpu"
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA device arguments to the CPU; CPU tensors report `torch.cuda.*` from `Tensor.type()`."""

    def __torch_function__(
        self, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype | torch.Tensor):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def stub_missing_kernels() -> None:
    """Let `import megatron.core` succeed without triton (no-op when triton is installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        return
    module = types.ModuleType(PAGED_STASH_MODULE)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("MoE paged-stash kernels need triton and CUDA")

    vars(module).update(GLOBAL_BLOCK_SIZE=1024, paged_stash_copy_kernel=unavailable, paged_stash_pop_kernel=unavailable)
    sys.modules.setdefault(PAGED_STASH_MODULE, module)


def _patch_torch_cuda() -> None:
    # Monkey-patching: the CPU stand-ins are duck-typed (_Stream for torch.cuda.Stream, a nullcontext for a
    # StreamContext, ...), which torch's declared types cannot express; hence the ignores below.
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # CudaToCpuMode maps the integer device to the CPU
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    cuda.Stream, cuda.Event = _Stream, _Event  # type: ignore[misc, assignment]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[misc, assignment]
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # Not manual_seed_all: torch.manual_seed calls it. (It returns the CPU generator where CUDA's returns None.)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _patch_megatron_rng() -> None:
    import megatron.core.tensor_parallel.random as megatron_random

    megatron_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)


def _patch_megatron_moe() -> None:
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = to_host

    from megatron.core.tensor_parallel.mappings import _AllToAll

    backward = _AllToAll.backward

    def backward_on_cpu(ctx: Any, *grad_output: torch.Tensor) -> Any:
        with CudaToCpuMode():
            return backward(ctx, *grad_output)

    _AllToAll.backward = staticmethod(backward_on_cpu)


def enter_mode() -> None:
    """Enter `CudaToCpuMode` on the calling thread (once per thread); a no-op when CUDA is present."""
    if not _installed or getattr(_thread_state, "mode", None) is not None:
        return
    _thread_state.mode = CudaToCpuMode()
    _thread_state.mode.__enter__()


def install() -> bool:
    """Make Megatron-core usable on this CPU-only process. Idempotent; returns False when CUDA is available."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        stub_missing_kernels()
        _patch_torch_cuda()
        _patch_megatron_rng()
        _patch_megatron_moe()
        _installed = True
    enter_mode()
    return True


def installed() -> bool:
    """Whether the CPU support is active in this process."""
    return _installed
