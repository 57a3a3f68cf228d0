"""The sender side of the trainer -> engine weight broadcast (SGLang's `update_weights_from_distributed` protocol).

The source rank of a pipeline stage joins a dedicated process group as rank 0 together with every engine rank
(created once with `init_weights_update_group`), packs the stage's HF-named tensors into buckets of
`sync.bucket_mb`, and for each bucket posts `update_weights_from_distributed` to every engine while it
broadcasts the flat bucket. With `sync.direct` (the default), a large HF tensor that is one contiguous piece of
memory the export keeps (a parameter at TP 1: gate, up, o, down, the embedding) is not copied: after the export,
such tensors go in batches sent in SGLang's per-tensor format, one broadcast from its own memory each; the
buckets go in that format too (one broadcast per tensor from its place in the bucket, which an engine can receive
straight into its parameter), and one goes before it is full when the wire would otherwise idle. One bucket or
batch is in flight at a time. Engines are paused and flushed by the caller.

Defences against what real SGLang 0.5.23 does (docs/engine.md, "Tested against SGLang"):
- it accepts a tensor name its model does not have, reports success and loads nothing: during the first push
  every name is looked up in the checkpoint each engine loaded (`sync/served.py`; not on the engine, since
  `/get_weights_by_name` answers for few model classes), and an unknown one fails the push;
- it answers a refused update (no session, unknown group, wrong shape) with 400, possibly after overwriting part
  of the weights, and a refused bucket's broadcast would then wait for the group timeout (30 min): the replies
  are read while the broadcast runs and the push is abandoned at the first refusal (`WeightUpdateRefusedError`, naming
  the engines; their weights must be considered corrupt);
- a group name stays taken on the engine until destroyed: `close()` destroys it there too.
"""

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.convert.assembly import TensorPlan
from userrl_megatron.sync.roles import EngineEndpoint, engine_offsets, group_world_size
from userrl_megatron.sync.served import served_names
from userrl_megatron.wire.bucket import FlatBuffer, dtype_name
from userrl_megatron.wire.group import destroy_custom_process_group, init_custom_process_group
from userrl_megatron.wire.sglang_payload import withdraw

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a push takes: HF-named tensors, or plans (`megatron.export.export_plans`) filled straight into the bucket.
Exported = tuple[str, torch.Tensor | TensorPlan]
# SGLang 0.5.23's /get_weights_by_name turns the whole tensor into a Python list before truncating it (GBs for a
# vocab-sized matrix of a real model): read-backs skip vocab-sized tensors and look at a sample.
VOCAB_SIZED = ("embed_tokens", "lm_head", "word_embeddings", "output_layer")
REFUSAL_GRACE_S = 30.0  # after a refusal, how long the other engines' replies to the same bucket are awaited
# A tensor goes on the wire from its own memory from this size on; smaller ones are copied into the buckets
# (holding back many small tensors until the export ends would save copies of little worth). In the per-tensor
# format each still takes a broadcast, whose per-call latency is small beside what that format saves: the
# engine's copy of every byte of a flattened bucket.
DIRECT_MIN_BYTES = 2**20
# A bucket holding this share of `sync.bucket_mb` goes on the wire before it is full when nothing else is in
# flight: the export's first bucket, or one exported slower than the previous one travels, does not leave the
# wire idle while it fills (at most this many times the HTTP calls of full buckets).
EARLY_SHARE = 8
CONTROL_TIMEOUT_S = 60.0  # deadline of the cleanup calls (session end, group teardown), whose failure is only logged
_ABANDONED: list[Any] = []  # groups with a broadcast nobody will finish: destroying them would block on it


class WeightUpdateRefusedError(RuntimeError):
    """One or more engines refused a weight update; their weights may be partly overwritten (SGLang loads tensor
    by tensor), so those engines must not generate again before they hold a complete set of weights."""

    def __init__(self, message: str, urls: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.urls = list(urls)

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `urls` across Ray's pickling
        return (type(self), (str(self), self.urls))


class UnknownWeightNameError(ValueError):
    """A pushed tensor name the engine's checkpoint does not have (SGLang would accept it and load nothing)."""


@dataclass
class _InFlight:
    """A bucket on its way: the broadcast's work handle and the engines' pending HTTP replies (engine order)."""

    work: Any
    replies: list[Future]
    names: list[str]
    packer: "_Packer | None" = None  # holds the bucket's memory until every engine answered (tensor handles)

    def landed(self) -> bool:
        """The broadcast is done and every engine answered (without waiting)."""
        return self.work.is_completed() and all(reply.done() for reply in self.replies)


class _Packer:
    """Fills one flat bucket, tensor by tensor, in SGLang's `flattened_bucket` layout (no padding).

    It goes on the wire as one broadcast (`flattened_bucket`), or with `per_tensor` as one broadcast per tensor from
    its place in the bucket (SGLang's per-tensor format): an engine receives each of those straight into its
    parameter, where a flattened bucket lands in a buffer it then copies from."""

    def __init__(self, buffer: FlatBuffer, per_tensor: bool = False) -> None:
        self.buffer = buffer
        self.load_format = None if per_tensor else "flattened_bucket"
        self.entries: list[tuple[str, torch.dtype, list[int], int, int]] = []  # name, dtype, shape, start, end
        self.nbytes = 0
        self._flat: torch.Tensor | None = None

    def fits(self, tensor: torch.Tensor | TensorPlan, bucket_bytes: int) -> bool:
        """Whether `tensor` still goes into this bucket (same dtype, within the size; a lone big tensor always)."""
        end = self.nbytes + tensor.numel() * tensor.element_size()
        return self.entries[-1][1] == tensor.dtype and end <= bucket_bytes

    def add(self, name: str, tensor: torch.Tensor | TensorPlan, bucket_bytes: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._flat is None:
            self._flat = self.buffer.take(max(bucket_bytes, nbytes))
        start, end = self.nbytes, self.nbytes + nbytes
        # Filled through a typed view of the bucket: strided pieces (q/k/v of a QKV shard) need no extra copy.
        plan = tensor if isinstance(tensor, TensorPlan) else TensorPlan.of(tensor)
        plan.fill(self._flat[start:end].view(tensor.dtype).view(tensor.shape))
        self.entries.append((name, tensor.dtype, list(tensor.shape), start, end))
        self.nbytes = end

    def flat(self) -> torch.Tensor:
        assert self._flat is not None
        return self._flat[: self.nbytes]

    def release(self, handed_out: int = 0) -> None:
        """Drop this packer's reference to the bucket memory, first taking back `handed_out` references that
        unread handle payloads hold (tensor handles)."""
        if self._flat is not None and handed_out:
            withdraw(self._flat, handed_out)
        self._flat = None

    def metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        return [e[0] for e in self.entries], [dtype_name(e[1]) for e in self.entries], [e[2] for e in self.entries]

    def broadcast(self, group: dist.ProcessGroup | None) -> Any:
        if self.load_format is not None:
            return dist.broadcast(self.flat(), group=group, group_src=0, async_op=True)
        flat = self.flat()
        tensors = [(name, flat[start:end].view(dtype).view(shape)) for name, dtype, shape, start, end in self.entries]
        return _Broadcasts.start(tensors, group)


class _Direct:
    """A batch of tensors broadcast one by one from their own memory (SGLang's per-tensor format, load_format
    None), each kept referenced until its broadcast completes."""

    load_format = None

    def __init__(self) -> None:
        self.entries: list[tuple[str, torch.Tensor]] = []
        self.nbytes = 0

    def fits(self, tensor: torch.Tensor, bucket_bytes: int) -> bool:
        return self.nbytes + _nbytes(tensor) <= bucket_bytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.entries.append((name, tensor))
        self.nbytes += _nbytes(tensor)

    def metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        return (
            [n for n, _ in self.entries],
            [dtype_name(t.dtype) for _, t in self.entries],
            [list(t.shape) for _, t in self.entries],
        )

    def broadcast(self, group: dist.ProcessGroup | None) -> "_Broadcasts":
        return _Broadcasts.start(self.entries, group)


class _Broadcasts:
    """Several broadcasts in flight as one work handle (they complete in order: one process group)."""

    def __init__(self, works: list[Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._works = works
        self._tensors = tensors  # the memory on the wire stays alive until the last broadcast is done

    @classmethod
    def start(cls, tensors: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> "_Broadcasts":
        """Broadcast each tensor from rank 0 of `group`, in order, without waiting."""
        return cls([dist.broadcast(t, group=group, group_src=0, async_op=True) for _, t in tensors], tensors)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def _direct_batches(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[_Direct]:
    """`tensors` in batches of at most `bucket_bytes` (a larger tensor alone), in order; none when empty."""
    batch = _Direct()
    for name, tensor in tensors:
        if batch.entries and not batch.fits(tensor, bucket_bytes):
            yield batch
            batch = _Direct()
        batch.add(name, tensor)
    if batch.entries:
        yield batch


def _nbytes(tensor: torch.Tensor | TensorPlan) -> int:
    return tensor.numel() * tensor.element_size()


def direct_tensor(tensor: torch.Tensor | TensorPlan, device: torch.device) -> torch.Tensor | None:
    """`tensor` as one tensor to broadcast from its own memory, or None when it must be packed: smaller than
    DIRECT_MIN_BYTES, not one contiguous piece, on another device than the group's, or in memory the export reuses
    before the broadcast would end (a transient plan). A direct tensor is held until the export ends: an export
    that builds its tensors anew, rather than handing out views of the model's, should yield them as transient
    plans, or it holds a copy of the model."""
    if isinstance(tensor, TensorPlan):
        if tensor.transient or len(tensor.pieces) != 1:
            return None
        piece = tensor.pieces[0]
        if not piece.is_contiguous():
            return None
        tensor = piece.view(tensor.shape)
    if _nbytes(tensor) < DIRECT_MIN_BYTES or tensor.device.type != device.type or not tensor.is_contiguous():
        return None
    return tensor.detach()


@dataclass
class _Tally:
    """What a push has sent so far."""

    bytes: int = 0
    packed: int = 0  # flat buckets (they alternate between the two buffers)
    direct: int = 0  # direct batches
    direct_bytes: int = 0

    def count(self, batch: "_Packer | _Direct") -> "_Packer | _Direct":
        self.bytes += batch.nbytes
        if isinstance(batch, _Direct):
            self.direct, self.direct_bytes = self.direct + 1, self.direct_bytes + batch.nbytes
        else:
            self.packed += 1
        return batch


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
        keys = {e.url: e.api_key for e in engines}
        factory = client_factory or (lambda url: _default_client(url, keys[url]))
        self._clients = [self._call(_construct(factory, e.url)) for e in engines]
        self._group: dist.ProcessGroup | None = None
        self._connected = False
        # NCCL broadcasts device memory, gloo host memory
        self._device = torch.device("cuda" if backend == "nccl" else "cpu")
        self._buffers = (FlatBuffer(self._device), FlatBuffer(self._device))  # double-buffered flat buckets, reused
        self._names_checked = False  # every name was found on every engine (done during the first push)
        self._served = [served_names(e.checkpoint) for e in engines]  # None: that engine's names are unknown
        for engine, names in zip(engines, self._served, strict=True):
            if names is None:
                log.warning(
                    "weight sync %s: the names pushed to %s are not checked: its checkpoint %r has no safetensors",
                    group_name, engine.url, engine.checkpoint,
                )  # fmt: skip
        self._broken = False  # a broadcast was abandoned: the group can carry nothing more

    @property
    def world_size(self) -> int:
        """Rank 0 (this sender) plus every engine rank."""
        return group_world_size(self.engines)

    def connect(self, master_address: str, master_port: int) -> None:
        """Create the group: every engine joins over HTTP while this process joins as rank 0."""
        offsets = engine_offsets(self.engines)
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
        self._connected = True
        log.info("weight-sync group %s: %d engines, world size %d", self.group_name, len(self.engines), self.world_size)

    def push(self, named_tensors: Iterable[Exported], version: int) -> dict[str, float]:
        """Broadcast every tensor to every engine, bucket by bucket; engines then report `version`.

        Tensors (or plans) are copied into the flat bucket as the export yields them (nothing else is kept), and
        the next bucket is exported and filled while the previous one is on the wire (gloo's thread) and being
        loaded (the engine, answering in the HTTP thread): two buffers, one bucket in flight. With `sync.direct`,
        tensors that can go on the wire from their own memory (`direct_tensor`) are only referenced during the
        export and sent after it, in batches of up to `sync.bucket_mb`: the packing never shares the cores with
        their broadcasts, and holding them costs no memory. The buckets then go in the per-tensor format too, and a
        bucket holding 1 / EARLY_SHARE of `sync.bucket_mb` is sent at once when nothing is in flight."""
        if not self._connected:
            raise RuntimeError(f"{type(self).__name__}.connect() must run before push()")
        if self._broken:
            raise RuntimeError(f"weight-sync group {self.group_name} was abandoned after a refusal; reconnect")
        clock, bucket_bytes = _Clock(), self.cfg.bucket_mb * 1024 * 1024
        self._all(lambda c: c.begin_weight_update())
        inflight: _InFlight | None = None
        packer, tally = self._new_packer(0), _Tally()
        held: list[tuple[str, torch.Tensor]] = []  # tensors to broadcast from their own memory
        failure: Exception | None = None
        for name, tensor in clock.timed_iter(named_tensors, "export"):
            if failure is not None:
                continue  # keep consuming the export: the stage's other ranks take part in its gathers
            try:
                if not self._names_checked:
                    self._check_name(name)
                own = direct_tensor(tensor, self._device) if self.cfg.direct else None
                if own is not None:
                    held.append((name, own))  # a reference: sent after the export, in batches
                    continue
                if packer.entries and not packer.fits(tensor, bucket_bytes):
                    inflight = self._send(tally.count(packer), version, inflight, clock)
                    packer = self._new_packer(tally.packed)
                with clock("pack"):
                    packer.add(name, tensor, bucket_bytes)
                if (
                    self.cfg.direct
                    and packer.nbytes * EARLY_SHARE >= bucket_bytes
                    and (inflight is None or inflight.landed())
                ):
                    inflight = self._send(tally.count(packer), version, inflight, clock)  # the wire would idle
                    packer = self._new_packer(tally.packed)
            except (UnknownWeightNameError, WeightUpdateRefusedError) as e:
                failure = e
        try:
            if failure is None:
                batches: list[_Packer | _Direct] = [packer] if packer.entries else []
                for batch in [*batches, *_direct_batches(held, bucket_bytes)]:
                    inflight = self._send(tally.count(batch), version, inflight, clock)
            if not isinstance(failure, WeightUpdateRefusedError):
                self._wait(inflight, clock)  # the bucket already on its way must land (or be refused) first
            if failure is not None:
                raise failure
        except (UnknownWeightNameError, WeightUpdateRefusedError):
            self._end_sessions()
            raise
        self._all(lambda c: c.end_weight_update())
        self._names_checked = True
        seconds = clock.elapsed()
        return {
            "sync/bytes": float(tally.bytes),
            "sync/buckets": float(tally.packed + tally.direct),  # flat buckets and direct batches
            "sync/direct_bytes": float(tally.direct_bytes),  # of `sync/bytes`, broadcast from their own memory
            "sync/seconds": seconds,
            "sync/gb_per_s": tally.bytes / max(seconds, 1e-9) / 1e9,
            **{f"sync/{k}_s": v for k, v in clock.totals.items()},
        }

    def _new_packer(self, index: int) -> "_Packer":
        """The packer of bucket `index` (the two flat buffers alternate); with `sync.direct`, its tensors go on the
        wire one by one from their place in it."""
        return _Packer(self._buffers[index % 2], per_tensor=self.cfg.direct)

    def _send(
        self, batch: "_Packer | _Direct", version: int, previous: "_InFlight | None", clock: "_Clock"
    ) -> "_InFlight":
        """Start one bucket (or direct batch) once the previous one has landed: the HTTP update on every engine,
        then the broadcast."""
        self._wait(previous, clock)
        names, dtypes, shapes = batch.metadata()
        replies = [
            self._loop.submit(
                c.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    self.group_name,
                    flush_cache=False,
                    weight_version=str(version),
                    load_format=batch.load_format,
                )
            )
            for c in self._clients
        ]
        return _InFlight(batch.broadcast(self._group), replies, names)

    def _wait(self, inflight: "_InFlight | None", clock: "_Clock") -> None:
        """Wait for the bucket's broadcast and the engines' replies; raise at the first refusal.

        A refusal usually comes before the broadcast completes (the engine never joins it, and the broadcast
        would wait for it until the group timeout), so the replies are watched while the broadcast runs."""
        if inflight is None:
            return
        with clock("broadcast"):
            while not inflight.work.is_completed():
                done, _ = wait_futures(inflight.replies, timeout=0.05, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    self._broken = True  # this broadcast may never finish
                    _ABANDONED.append(self._group)
                    self._raise_refusals(inflight, REFUSAL_GRACE_S)
                if len(done) == len(inflight.replies):
                    time.sleep(0.001)  # every engine answered: the local side of the broadcast is finishing
            try:
                inflight.work.wait()
            except RuntimeError:  # a peer left the group: its refusal may still be on its way, and says why
                self._broken = True
                _ABANDONED.append(self._group)
                wait_futures(inflight.replies, timeout=REFUSAL_GRACE_S, return_when=FIRST_EXCEPTION)
                self._raise_refusals(inflight, REFUSAL_GRACE_S)
                raise
        with clock("engine_load"):
            wait_futures(inflight.replies, return_when=FIRST_EXCEPTION)
            self._raise_refusals(inflight, REFUSAL_GRACE_S)

    def _raise_refusals(self, inflight: "_InFlight", grace_s: float) -> None:
        """Raise `WeightUpdateRefusedError` naming every engine that refused (waiting up to `grace_s` for the rest)."""
        if not any(f.done() and f.exception() is not None for f in inflight.replies):
            return
        wait_futures(inflight.replies, timeout=grace_s)
        refused = [
            (engine.url, f.exception() if f.done() else TimeoutError(f"no answer within {grace_s:.0f}s"))
            for engine, f in zip(self.engines, inflight.replies, strict=True)
            if not f.done() or f.exception() is not None
        ]
        detail = "; ".join(f"{url}: {error}" for url, error in refused)
        raise WeightUpdateRefusedError(
            f"weight update refused by {len(refused)} of {len(self.engines)} engines (bucket of "
            f"{len(inflight.names)} tensors starting at {inflight.names[0]}): {detail}",
            [url for url, _ in refused],
        )

    def _check_name(self, name: str) -> None:
        """Every engine must know `name`: SGLang would accept an unknown one, bump its version and load nothing."""
        for engine, names in zip(self.engines, self._served, strict=True):
            if names is not None and name not in names:
                raise UnknownWeightNameError(
                    f"the engine at {engine.url} has no weight named {name!r} (its checkpoint {engine.checkpoint} "
                    "holds none); the pushed names must be the engine model's Hugging Face parameter names"
                )

    def _end_sessions(self) -> None:
        """Close the weight-update sessions of a failed push (engines that are gone or refuse are skipped)."""
        futures = [self._loop.submit(asyncio.wait_for(c.end_weight_update(), CONTROL_TIMEOUT_S)) for c in self._clients]
        for future in futures:
            with contextlib.suppress(Exception):
                future.result()

    def close(self) -> None:
        """Leave the group (also on every engine, so its name can be used again) and stop the HTTP thread."""
        if self._group is not None:
            teardown = [
                self._loop.submit(asyncio.wait_for(c.destroy_weights_update_group(self.group_name), CONTROL_TIMEOUT_S))
                for c in self._clients
            ]
            if not self._broken:
                destroy_custom_process_group(self._group)
            self._group = None
            for engine, future in zip(self.engines, teardown, strict=True):
                try:
                    future.result()
                except Exception as e:  # a dead or restarted engine no longer has the group
                    log.warning("weight-sync group %s on %s not destroyed: %s", self.group_name, engine.url, e)
        self._connected = False
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


def name_pattern(name: str) -> str:
    """`model.layers.17.mlp.up_proj.weight` -> `model.layers.N.mlp.up_proj.weight`."""
    return re.sub(r"\.\d+\.", ".N.", name)


def sample_names(names: Sequence[str]) -> list[str]:
    """Tensors to read back after a sync: the first, middle and last of each name pattern, vocab-sized ones left
    out (see VOCAB_SIZED)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if not any(v in name for v in VOCAB_SIZED):
            groups.setdefault(name_pattern(name), []).append(name)
    picked = {g[i] for g in groups.values() for i in (0, len(g) // 2, -1)}
    return [n for n in names if n in picked]


async def _construct(factory: Callable[[str], Any], url: str) -> Any:
    """Build a client inside the sender's loop (aiohttp sessions are bound to the loop that creates them)."""
    return factory(url)


def _default_client(url: str, api_key: str = "") -> Any:
    from userrl_megatron.fleet.engine import SGLangClient

    return SGLangClient(url, api_key=api_key)
