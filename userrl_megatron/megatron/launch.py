"""Run a function on N local ranks (spawned processes): the converters, the benchmark and the tests use it.

`run_local(fn, world_size, *args)` calls `fn(rank, world_size, port, *args)` in `world_size` fresh
processes (spawn context: Megatron must not be imported before the CPU support is installed) and returns
every rank's result, in rank order. Each rank stubs the triton-only module (`cpu.stub_missing_kernels`) before
it unpickles `fn` and its arguments, so both may import megatron.core. If any rank fails, the others are
stopped and the failing rank's traceback is raised. Results cross a process boundary: return plain Python data
or numpy arrays (tensors pickled in a process that imported megatron.core need megatron.core, and the CPU
support, to unpickle).
"""

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from userrl_megatron.cores import core_count
from userrl_megatron.ports import free_port


class RankError(RuntimeError):
    """A rank of `run_local` raised or died."""


def _worker(call: bytes, rank: int, world_size: int, port: int, threads: int, out: Any) -> None:
    """One rank: `call` is the pickled (fn, args), unpickled once megatron.core can be imported."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    from userrl_megatron.megatron.cpu import stub_missing_kernels
    from userrl_megatron.observability.noise import quiet_third_party

    quiet_third_party(on_gpu=torch.cuda.is_available())  # each rank would repeat Megatron's import warnings
    stub_missing_kernels()  # before `fn`'s module, or a tensor among the arguments, imports megatron.core
    torch.set_num_threads(threads)
    try:
        fn, args = pickle.loads(call)
        out.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0, threads_per_rank: int | None = None
) -> list[Any]:
    """Run `fn(rank, world_size, port, *args)` on `world_size` spawned ranks; returns their results.

    `fn` must be importable (a module-level function). Raises RankError with the first failure's traceback,
    or when `timeout_s` passes without every rank reporting.
    """
    threads = threads_per_rank or max(1, core_count() // world_size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    call = pickle.dumps((fn, args))
    procs = [
        ctx.Process(target=_worker, args=(call, rank, world_size, port, threads, out), daemon=False)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if crashed:
                    codes = [procs[r].exitcode for r in crashed]
                    raise RankError(f"ranks {crashed} exited with codes {codes} without reporting") from None
                if time.monotonic() > deadline:
                    raise RankError(
                        f"ranks {sorted(set(range(world_size)) - results.keys())} did not report within {timeout_s} s"
                    ) from None
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        _reap(procs, grace_s=30.0 if len(results) == world_size else 1.0)
    return [results[r] for r in range(world_size)]


def _reap(procs: list[Any], grace_s: float) -> None:
    """Wait up to `grace_s` for the ranks to exit, then terminate the rest. Polled by exit status, not by
    `Process.join`: join waits on a pipe that a process the rank started can inherit and keep open after the rank
    has exited (the tensor-handle sync's ranks did), so it would sit out the whole grace, rank after rank."""
    deadline = time.monotonic() + grace_s
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join()
