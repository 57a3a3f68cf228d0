"""The sender side of the trainer -> engine weight broadcast (SGLang's `update_weights_from_distributed` protocol).

The source rank of a pipeline stage joins a dedicated process group as rank 0 together with every engine rank
(created once with `init_weights_update_group`), packs the stage's HF-named tensors into buckets of
`sync.bucket_mb`, and for each bucket posts `update_weights_from_distributed` to every engine while it
broadcasts the flat bucket. One bucket is in flight at a time. Engines are paused and flushed by the caller.
"""

import asyncio
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
from userrl_megatron.sync.bucket import dtype_name, pack_bucket
from userrl_megatron.sync.group import destroy_custom_process_group, init_custom_process_group

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class EngineEndpoint:
    """One engine as the sender sees it: its URL and how many ranks it adds to the group (its TP size)."""

    url: str
    tp_size: int = 1


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone).

    A dtype change also starts a new bucket, so every tensor in a flat bucket is aligned to its itemsize.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[-1][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


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
        """Broadcast every tensor to every engine, bucket by bucket; engines then report `version`."""
        if self._group is None:
            raise RuntimeError("WeightSender.connect() must run before push()")
        start, sent, buckets = time.perf_counter(), 0, 0
        self._all(lambda c: c.begin_weight_update())
        for bucket in iter_buckets(named_tensors, self.cfg.bucket_mb * 1024 * 1024):
            flat, _ = pack_bucket(bucket)
            names = [name for name, _ in bucket]
            dtypes = [dtype_name(t.dtype) for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            pending = [
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
            dist.broadcast(flat, group=self._group, group_src=0)
            for future in pending:
                future.result()
            sent += flat.numel()
            buckets += 1
        self._all(lambda c: c.end_weight_update())
        seconds = time.perf_counter() - start
        return {
            "sync/bytes": float(sent),
            "sync/buckets": float(buckets),
            "sync/seconds": seconds,
            "sync/gb_per_s": sent / max(seconds, 1e-9) / 1e9,
        }

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
