"""The sender side of the trainer -> engine weight broadcast (SGLang's `update_weights_from_distributed` protocol).

The source rank of a pipeline stage joins a dedicated process group as rank 0 together with every engine rank
(created once with `init_weights_update_group`), packs the stage's HF-named tensors into buckets of
`sync.bucket_mb`, and for each bucket posts `update_weights_from_distributed` to every engine while it
broadcasts the flat bucket. One bucket is in flight at a time. Engines are paused and flushed by the caller.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.bucket import FlatBuffer, dtype_name
from userrl_megatron.sync.group import destroy_custom_process_group, init_custom_process_group

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class EngineEndpoint:
    """One engine as the sender sees it: its URL and how many ranks it adds to the group (its TP size)."""

    url: str
    tp_size: int = 1


@dataclass
class _InFlight:
    """A bucket on its way: the broadcast's work handle and the engines' pending HTTP replies."""

    work: Any
    replies: list[Future]


class _Packer:
    """Fills one flat bucket, tensor by tensor, in SGLang's `flattened_bucket` layout (no padding)."""

    def __init__(self, buffer: FlatBuffer) -> None:
        self.buffer = buffer
        self.entries: list[tuple[str, torch.dtype, list[int], int, int]] = []  # name, dtype, shape, start, end
        self.nbytes = 0
        self._flat: torch.Tensor | None = None

    def fits(self, tensor: torch.Tensor, bucket_bytes: int) -> bool:
        """Whether `tensor` still goes into this bucket (same dtype, within the size; a lone big tensor always)."""
        same_dtype = self.entries[-1][1] == tensor.dtype
        return same_dtype and self.nbytes + tensor.numel() * tensor.element_size() <= bucket_bytes

    def add(self, name: str, tensor: torch.Tensor, bucket_bytes: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._flat is None:
            self._flat = self.buffer.take(max(bucket_bytes, nbytes))
        start, end = self.nbytes, self.nbytes + nbytes
        # Copy through a typed view of the bucket: a strided source (a q/k/v split) needs no extra copy.
        self._flat[start:end].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        self.entries.append((name, tensor.dtype, list(tensor.shape), start, end))
        self.nbytes = end

    def flat(self) -> torch.Tensor:
        assert self._flat is not None
        return self._flat[: self.nbytes]

    def metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        return [e[0] for e in self.entries], [dtype_name(e[1]) for e in self.entries], [e[2] for e in self.entries]


class _Clock:
    """Accumulates the seconds spent in each phase of a push."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - begin

    def timed_iter(self, items: Iterable[T], phase: str) -> Iterator[T]:
        """`items`, with the time spent producing each one (e.g. TP gathers) added to `phase`."""
        iterator = iter(items)
        while True:
            with self(phase):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


_END = object()


class _EventLoopThread:
    """An asyncio loop in a daemon thread, so HTTP calls can run while this thread blocks in a broadcast."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable[T]) -> "Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class WeightSender:
    """Rank 0 of the weight-update group: connects to the engines once, then pushes weights every step."""

    def __init__(
        self,
        cfg: SyncConfig,
        engines: list[EngineEndpoint],
        group_name: str = "userrl_weight_sync",
        backend: str = "gloo",
        client_factory: Callable[[str], Any] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("weight sync needs at least one engine")
        self.cfg = cfg
        self.engines = engines
        self.group_name = group_name
        self.backend = backend
        self._loop = _EventLoopThread()
        factory = client_factory or _default_client
        self._clients = [self._call(_construct(factory, e.url)) for e in engines]
        self._group: dist.ProcessGroup | None = None
        device = "cuda" if backend == "nccl" else "cpu"  # NCCL broadcasts device memory, gloo host memory
        self._buffers = (FlatBuffer(device), FlatBuffer(device))  # double-buffered flat buckets, reused

    @property
    def world_size(self) -> int:
        """Rank 0 (this sender) plus every engine rank."""
        return 1 + sum(e.tp_size for e in self.engines)

    def connect(self, master_address: str, master_port: int) -> None:
        """Create the group: every engine joins over HTTP while this process joins as rank 0."""
        offsets = [1 + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        pending = [
            self._loop.submit(
                client.init_weights_update_group(
                    master_address, master_port, offset, self.world_size, self.group_name, self.backend
                )
            )
            for client, offset in zip(self._clients, offsets, strict=True)
        ]
        self._group = init_custom_process_group(
            self.backend, f"tcp://{master_address}:{master_port}", self.world_size, 0, self.group_name
        )
        for future in pending:
            future.result()
        log.info("weight-sync group %s: %d engines, world size %d", self.group_name, len(self.engines), self.world_size)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Broadcast every tensor to every engine, bucket by bucket; engines then report `version`.

        Tensors are copied into the flat bucket as the export yields them (nothing else is kept), and the
        next bucket is filled while the previous one is on the wire and being loaded (two buffers, one
        bucket in flight)."""
        if self._group is None:
            raise RuntimeError("WeightSender.connect() must run before push()")
        clock, bucket_bytes = _Clock(), self.cfg.bucket_mb * 1024 * 1024
        self._all(lambda c: c.begin_weight_update())
        inflight: _InFlight | None = None
        packer = _Packer(self._buffers[0])
        sent = buckets = 0
        for name, tensor in clock.timed_iter(named_tensors, "export"):
            if packer.entries and not packer.fits(tensor, bucket_bytes):
                inflight = self._send(packer, version, inflight, clock)
                sent, buckets = sent + packer.nbytes, buckets + 1
                packer = _Packer(self._buffers[buckets % 2])
            with clock("pack"):
                packer.add(name, tensor, bucket_bytes)
        if packer.entries:
            inflight = self._send(packer, version, inflight, clock)
            sent, buckets = sent + packer.nbytes, buckets + 1
        self._wait(inflight, clock)
        self._all(lambda c: c.end_weight_update())
        seconds = clock.elapsed()
        return {
            "sync/bytes": float(sent),
            "sync/buckets": float(buckets),
            "sync/seconds": seconds,
            "sync/gb_per_s": sent / max(seconds, 1e-9) / 1e9,
            **{f"sync/{k}_s": v for k, v in clock.totals.items()},
        }

    def _send(self, packer: "_Packer", version: int, previous: "_InFlight | None", clock: "_Clock") -> "_InFlight":
        """Start one bucket once the previous one has landed: the HTTP update on every engine, then the broadcast."""
        self._wait(previous, clock)
        names, dtypes, shapes = packer.metadata()
        replies = [
            self._loop.submit(
                c.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    self.group_name,
                    flush_cache=False,
                    weight_version=str(version),
                    load_format="flattened_bucket",
                )
            )
            for c in self._clients
        ]
        work = dist.broadcast(packer.flat(), group=self._group, group_src=0, async_op=True)
        return _InFlight(work, replies)

    @staticmethod
    def _wait(inflight: "_InFlight | None", clock: "_Clock") -> None:
        if inflight is None:
            return
        with clock("broadcast"):
            inflight.work.wait()
        with clock("engine_load"):
            for reply in inflight.replies:
                reply.result()

    def close(self) -> None:
        """Leave the group and stop the HTTP thread."""
        if self._group is not None:
            destroy_custom_process_group(self._group)
            self._group = None
        for client in self._clients:
            close = getattr(client, "close", None)
            if close is not None:
                self._call(close())
        self._loop.close()

    def _call(self, coro: Awaitable[T]) -> T:
        return self._loop.submit(coro).result()

    def _all(self, fn: Callable[[Any], Awaitable[Any]]) -> None:
        for future in [self._loop.submit(fn(c)) for c in self._clients]:
            future.result()


async def _construct(factory: Callable[[str], Any], url: str) -> Any:
    """Build a client inside the sender's loop (aiohttp sessions are bound to the loop that creates them)."""
    return factory(url)


def _default_client(url: str) -> Any:
    from userrl_megatron.rollout.engine import SGLangClient

    return SGLangClient(url)
