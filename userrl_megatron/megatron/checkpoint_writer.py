"""Runs the writes of a dist-checkpoint save, inline or on a background thread while training goes on.

Megatron's `dist_checkpointing.save(..., async_sharded_save=True)` plans the save (collective) and returns an
`AsyncRequest`: a function that writes this rank's files and the finalize functions that must then run on every
rank (gather the write results, write the metadata). `CheckpointWriter` executes such requests:

- inline (`background=False`): write, then finalize at once (what Megatron's synchronous save does);
- in the background: first copy every tensor the request will write into host staging buffers (kept from one
  save to the next: pinned on GPU, so the copy is one non-blocking D2H per tensor), then write from those
  buffers on a thread; the training step goes on at once. Without the staging copy the writer would read
  parameters that the next optimizer step changes in place, or that an offload frees (on CPU as on GPU: the
  staging is not a GPU detail). `poll` (collective, every rank at the same point) finalizes once every rank's
  writer is done; `wait` blocks until then.

Either way, the thread that wrote a file then hashes it (SHA-256 of the bytes read back, mostly from the page
cache: about 0.7 GB/s per core, the GIL released) for the checkpoint's manifest, which a resume checks.

Megatron's own `AsyncCallsQueue` forks a process after copying device tensors to pageable host memory, once
per save. Here the copy goes to buffers allocated once, and the writer is a thread: no fork of a process that
holds a CUDA context, Ray's threads and gloo. On CPU, Megatron's planner has already cloned the tensors that
are views of live storage (the parameters in DDP's buffers), so the staging copy is a second one there; it is
kept so that the path a GPU run takes is the one the CPU tests run.
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from userrl_megatron.run.checkpoint_files import record_digests

Finalize = Callable[[], None]
log = logging.getLogger(__name__)


def _write_and_hash(write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Megatron's write function, then the SHA-256 of each file it wrote (`checkpoint_files.record_digests`), on
    the same thread: the digests cost the writer thread, never the training step. `args` are Megatron's
    (rank, write buckets, results queue); a bucket's first item is its file's path."""
    write(*args, **kwargs)
    try:
        record_digests(sorted({bucket[0] for bucket in args[1]}))
    except OSError as e:  # the manifest hashes them itself; a failed write shows in Megatron's finalize
        log.warning("hashing the checkpoint files just written failed (%s); the commit hashes them", e)


class CheckpointWriter:
    """Executes one checkpoint request at a time; a new one first finishes the previous one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: dict[tuple[int, int], torch.Tensor] = {}  # (file, tensor) index -> host buffer
        self._thread: threading.Thread | None = None
        self._finalize: list[Finalize] = []

    @property
    def pending(self) -> bool:
        """A background save has been started and not yet finalized."""
        return bool(self._finalize)

    def run(self, request: Any, background: bool) -> None:
        """Execute `request` (a Megatron `AsyncRequest`: a write function and the finalize functions every rank
        runs after it). Collective. In the background, returns once the tensors are staged."""
        self.wait()
        functions = list(request.finalize_fns)
        if request.async_fn is None:  # nothing to write on this rank; the finalize functions still run
            args: list[Any] = []
        else:
            args = list(request.async_fn_args)  # (rank, write buckets, results queue)
            if background:
                args[1] = self._stage(args[1])
            elif request.preload_fn is not None:
                args[1] = request.preload_fn()  # Megatron's own copy of device tensors to the host (none on CPU)
        if not background:
            if request.async_fn is not None:
                _write_and_hash(request.async_fn, *args, **request.async_fn_kwargs)
            for fn in functions:
                fn()
            return
        self._finalize = functions
        if request.async_fn is not None:
            # A failed write reaches every rank through Megatron's finalize (its results queue), which raises.
            self._thread = threading.Thread(
                target=_write_and_hash, args=(request.async_fn, *args), kwargs=request.async_fn_kwargs, daemon=True
            )
            self._thread.start()

    def poll(self) -> bool:
        """Finalize the background save if every rank's writer is done; True when nothing is left pending.
        Collective: every rank calls it at the same point."""
        if not self.pending:
            return True
        busy = torch.tensor([int(self._thread is not None and self._thread.is_alive())], device=self.device)
        torch.distributed.all_reduce(busy)
        if busy.item():
            return False
        self._complete()
        return True

    def wait(self) -> None:
        """Block until the background save (if any) is written and finalized. Collective."""
        if not self.pending:
            return
        if self._thread is not None:
            self._thread.join()
        self._complete()

    def _complete(self) -> None:
        functions, self._finalize, self._thread = self._finalize, [], None
        for fn in functions:
            fn()

    def _stage(self, buckets: list[Any]) -> list[Any]:
        """Copy every tensor of the write buckets into host buffers reused across saves."""
        staged = []
        for f, (file_name, storage_key, (bytes_data, tensor_data)) in enumerate(buckets):
            copies = []
            for t, (item, tensor) in enumerate(tensor_data):
                buffer = self._staging.get((f, t))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = torch.empty(
                        tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type == "cuda"
                    )
                    self._staging[(f, t)] = buffer
                buffer.copy_(tensor.detach(), non_blocking=True)
                copies.append((item, buffer))
            staged.append((file_name, storage_key, (bytes_data, copies)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the D2H copies above are asynchronous
        return staged
