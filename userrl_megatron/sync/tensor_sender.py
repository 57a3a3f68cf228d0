"""The sender side of colocated weight sync: buckets handed to the engines as handles (SGLang's
`update_weights_from_tensor`), for engines that share the trainer's devices.

A colocated run cannot use the broadcast of `sender.WeightSender`: NCCL refuses a group in which two ranks use one
GPU. Here a pipeline stage's HF-named tensors are packed into buckets of `sync.bucket_mb` exactly as on the
broadcast path (SGLang's `flattened_bucket` layout), but each bucket lives in memory another process can map
(`handles.py`: CUDA IPC on GPU, a named shared-memory file on CPU), and every engine gets one small payload per TP
rank naming that memory, in the format its backend reads (`EngineEndpoint.backend`): the embedded engine's own,
a JSON header that executes nothing (`embedded_payload.py`), or SGLang's pickle (`sglang_payload.py`). The engine
copies the tensors into its weights and answers. Buckets alternate between two segments kept across buckets
(`SharedBuffer`), and one bucket is in flight while the next is packed, so a segment is written again only after
every engine answered for the bucket in it. On CPU the segments also stay from push to push and the embedded
engine keeps its mapping of each (`handles.Segments`), so nothing is created, mapped or removed per bucket. On GPU
an engine opens a bucket's IPC handle for that bucket only, and the segments last one push: after the engines'
`/end_weight_update` they are dropped and their device memory goes back to rollout and training, which on a
colocated GPU need it more than the next push needs to skip two allocations.

Which memory an engine TP rank maps: engine TP rank j of an engine whose first device is d sits on device d + j;
actor rank r sits on device r (`fleet/placement.py`). When that actor rank belongs to the stage (whatever its TP,
DP or CP rank), it packs its own copy of every bucket (the export all-gathers the shards) and the engine rank maps
memory on its own GPU (with one pipeline stage no handle crosses nodes); otherwise it maps the stage source
rank's copy. At each bucket boundary the stage's ranks gather their payloads on the source rank, which posts one
request per engine, and the source then tells the others whether the previous bucket landed, so they can drop it
(`Peers`; a group of one needs no collective).

Defences (what real SGLang 0.5.23 does on this path, docs/engine.md):
- an unknown tensor name is accepted and ignored: every name is looked up on every engine before the first push;
- a tensor of the wrong shape kills the SGLang server (an assertion in its scheduler): the push fails naming the
  engine (`WeightUpdateRefusedError`), which the pool then restarts;
- a refusal (no session, a dead engine) fails the push naming the engines, as on the broadcast path.
"""

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.roles import payload_holders
from userrl_megatron.sync.sender import (
    REFUSAL_GRACE_S,
    EngineEndpoint,
    Exported,
    UnknownWeightNameError,
    WeightSender,
    WeightUpdateRefusedError,
    _Clock,
    _InFlight,
    _Packer,
)
from userrl_megatron.wire.bucket import BucketEntry
from userrl_megatron.wire.embedded_payload import write_payload
from userrl_megatron.wire.handles import hold, retire, sweep_segments, through_shm_manager
from userrl_megatron.wire.sglang_payload import flattened_bucket, serialize

log = logging.getLogger(__name__)
OWN_FORMAT_BACKENDS = ("embedded",)  # engines that read `embedded_payload.py`; the others get SGLang's pickle


class SharedBuffer:
    """One segment of memory another process can map, kept across buckets and pushes and grown when a bucket
    needs more (as `FlatBuffer` on the broadcast path): a named shared-memory file on CPU, held (`handles.hold`)
    while kept, device memory (shared through CUDA IPC when pickled) on GPU. Views are valid until `take` grows it;
    the caller takes it again only once every engine answered for the bucket in it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._data: torch.Tensor | None = None
        self._lock_fd: int | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of the first `nbytes` bytes of the segment (contents undefined)."""
        if self._data is None or self._data.numel() < nbytes:
            self.release()
            self._data = self._new(nbytes)
        return self._data[:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        storage = through_shm_manager(lambda: torch.UntypedStorage._new_using_filename_cpu(nbytes))
        self._lock_fd = hold(storage)
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    def release(self) -> None:
        """Let go of the segment: on CPU its file is removed now (engines that mapped it keep their mapping until
        they let go) and its lock dropped."""
        if self._data is not None and self._lock_fd is not None:
            retire(self._data.untyped_storage())
            os.close(self._lock_fd)
        self._data, self._lock_fd = None, None


@dataclass
class Peers:
    """A pipeline stage's ranks (tensor x data x context parallel), each member packing its own copy of every
    bucket."""

    group: Any  # torch.distributed process group of the members
    ranks: list[int]  # their global ranks, in group order; ranks[0] is the stage's source rank
    rank: int  # this process's global rank

    def gather(self, payloads: list[str]) -> list[list[str]] | None:
        """Every member's payloads, on the source rank (None elsewhere)."""
        out: list[Any] | None = [None] * len(self.ranks) if self.rank == self.ranks[0] else None
        dist.gather_object(payloads, out, dst=self.ranks[0], group=self.group)
        return out

    def announce(self, status: str | None) -> str | None:
        """The source rank's word on the last bucket (None: it landed), given to every member."""
        box = [status]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]


@dataclass
class _State:
    """One push's progress, on every member of the group."""

    inflight: _InFlight | None = None  # source: the posted bucket awaiting its answers
    held: _Packer | None = None  # other members: their copy of the posted bucket
    failure: Exception | None = None  # source: why the push failed (announced at the next boundary)
    stopped: bool = False  # a failure was announced: nobody packs or exchanges again
    sent: int = 0
    buckets: int = 0
    from_peers: int = 0  # payloads another member of the group made (source)


class TensorSender(WeightSender):
    """Pushes weights to engines on this node through tensor handles; same interface as `WeightSender`.

    With `peers`, every rank of the stage runs `push` on the same export (all-gathered); the source
    rank (ranks[0]) talks to the engines, the others only pack and hand over their payloads."""

    def __init__(
        self,
        cfg: SyncConfig,
        engines: list[EngineEndpoint],
        group_name: str = "userrl_weight_sync",
        device: torch.device | str = "cpu",
        client_factory: Callable[[str], Any] | None = None,
        peers: Peers | None = None,
    ) -> None:
        super().__init__(cfg, engines, group_name, "gloo", client_factory)
        self.device = torch.device(device)
        self.peers = peers
        self.rank = peers.rank if peers else 0
        self.source = peers is None or peers.rank == peers.ranks[0]
        self.holders = payload_holders(engines, peers.ranks if peers else [0])
        # The payloads this member makes per bucket, in the order the source hands them out: whether each is in the
        # embedded engine's own format (else SGLang's pickle, of which `pickles` hand out storage references).
        self.own_format = [
            engine.backend in OWN_FORMAT_BACKENDS
            for engine, row in zip(engines, self.holders, strict=True)
            for holder in row
            if holder == self.rank
        ]
        self.mine = len(self.own_format)
        self.pickles = self.own_format.count(False)
        self._segments = (SharedBuffer(self.device), SharedBuffer(self.device))  # alternate, as `_buffers`
        self.keep_segments = self.device.type == "cpu"  # across pushes; on GPU one push only (module docstring)
        if self.device.type == "cpu" and (swept := sweep_segments()):
            log.info("removed %d shared-memory segments of senders that are gone: %s", len(swept), swept)

    def connect(self, master_address: str = "", master_port: int = 0) -> None:
        """Nothing to set up: handles need no process group (the arguments keep `WeightSender`'s interface)."""
        self._connected = True
        log.info("weight sync %s: %d engines, tensor handles on %s", self.group_name, len(self.engines), self.device)

    def push(self, named_tensors: Iterable[Exported], version: int) -> dict[str, float]:
        """Hand every tensor to every engine, bucket by bucket; engines then report `version`. Collective over
        `peers` (each member passes the same export)."""
        if not self._connected:
            raise RuntimeError("TensorSender.connect() must run before push()")
        clock, bucket_bytes, state = _Clock(), self.cfg.bucket_mb * 1024 * 1024, _State()
        if self.source:
            self._all(lambda c: c.begin_weight_update())
        packer = self._new_packer(0)
        for name, tensor in clock.timed_iter(named_tensors, "export"):
            if state.stopped:
                continue  # keep consuming the export: the stage's other ranks take part in its gathers
            if self.source and state.failure is None and not self._names_checked:
                try:
                    self._check_name(name)
                except UnknownWeightNameError as e:
                    state.failure = e  # announced at the next boundary; until then everyone packs alike
            if packer.entries and not packer.fits(tensor, bucket_bytes):
                self._exchange(packer, version, state, clock)
                packer = self._new_packer(state.buckets)
                if state.stopped:
                    continue
            with clock("pack"):
                packer.add(name, tensor, bucket_bytes)
        if not state.stopped and packer.entries:
            self._exchange(packer, version, state, clock)
        self._finish(state, clock)
        if state.stopped:  # an engine may not have answered for its bucket: no segment of this push is rewritten
            self._release_segments()
        if state.failure is not None:
            self._end_sessions()
            raise state.failure
        try:
            if self.source:
                self._all(lambda c: c.end_weight_update())
        finally:
            if not state.stopped and not self.keep_segments:
                self._give_back_segments()
        if not self.source:
            return {}
        self._names_checked = True
        seconds = clock.elapsed()
        return {
            "sync/bytes": float(state.sent),
            "sync/buckets": float(state.buckets),
            "sync/seconds": seconds,
            "sync/gb_per_s": state.sent / max(seconds, 1e-9) / 1e9,
            "sync/handles_from_peers": float(state.from_peers),
            **{f"sync/{k}_s": v for k, v in clock.totals.items()},
        }

    def _new_packer(self, index: int) -> _Packer:
        """The packer of bucket `index`: its segment last held bucket `index - 2`, which has landed by now (one
        bucket in flight)."""
        return _Packer(self._segments[index % 2])  # type: ignore[arg-type]

    def _exchange(self, packer: _Packer, version: int, state: _State, clock: _Clock) -> None:
        """One bucket boundary on every member: payloads to the source, which waits for the previous bucket and
        posts this one (unless the push failed), then says whether the previous one landed."""
        state.sent, state.buckets = state.sent + packer.nbytes, state.buckets + 1
        with clock("serialize"):
            if self.device.type == "cuda":  # the engines read what is written, whether or not they wait on the event
                torch.cuda.synchronize(self.device)
            mine = [self._payload(packer, own) for own in self.own_format]
        payloads = self.peers.gather(mine) if self.peers else [mine]
        status = None
        if self.source:
            self._land(state, clock)
            if state.failure is None:
                assert payloads is not None
                state.inflight = self._post(packer, payloads, version, state)
            else:
                packer.release(handed_out=self.pickles)  # never posted: nobody will read this rank's payloads
            status = None if state.failure is None else f"{type(state.failure).__name__}: {state.failure}"
        self._after(status, packer, state)

    @staticmethod
    def _payload(packer: _Packer, own_format: bool) -> str:
        """One engine TP rank's payload of the packed bucket: its tensors placed in the segment (the embedded
        engine's format), or SGLang's `flattened_bucket` pickle."""
        flat = packer.flat()
        if own_format:
            return write_payload([(n, flat[a:b].view(dtype).view(shape)) for n, dtype, shape, a, b in packer.entries])
        return serialize(flattened_bucket(flat, bucket_entries(packer.entries)))

    def _finish(self, state: _State, clock: _Clock) -> None:
        """After the export: the last bucket lands (or not), and every member lets go of its copy."""
        status = None
        if self.source:
            self._land(state, clock)
            status = None if state.failure is None else f"{type(state.failure).__name__}: {state.failure}"
        if not state.stopped:
            self._after(status, None, state)

    def _land(self, state: _State, clock: _Clock) -> None:
        """Source: wait for the posted bucket's answers, then drop it; a refusal becomes the push's failure."""
        if state.inflight is None:
            return
        inflight, state.inflight = state.inflight, None
        try:
            self._wait(inflight, clock)
        except WeightUpdateRefusedError as e:
            state.failure = state.failure or e

    def _after(self, status: str | None, posted: _Packer | None, state: _State) -> None:
        """Every member learns the source's word: the previous bucket is dropped; after a failure, all stop."""
        if self.peers:
            status = self.peers.announce(status)
        if not self.source:
            if state.held is not None:
                state.held.release()
            state.held = posted if status is None else None
            if status is not None and posted is not None:
                posted.release(handed_out=self.pickles)  # the source did not post it
        if status is not None:
            state.stopped = True
            if not self.source:
                log.info("weight sync %s: the source rank stopped the push (%s)", self.group_name, status)

    def _post(self, packer: _Packer, payloads: list[list[str]], version: int, state: _State) -> _InFlight:
        """Source: one `/update_weights_from_tensor` per engine, each TP rank's payload from its holder."""
        ranks = self.peers.ranks if self.peers else [0]
        queues = {rank: list(made) for rank, made in zip(ranks, payloads, strict=True)}
        per_engine = []
        for row in self.holders:
            per_engine.append([queues[holder].pop(0) for holder in row])
            state.from_peers += sum(holder != self.rank for holder in row)
        replies = [
            self._loop.submit(
                client.update_weights_from_tensor(
                    body, load_format="flattened_bucket", flush_cache=False, weight_version=str(version)
                )
            )
            for client, body in zip(self._clients, per_engine, strict=True)
        ]
        return _InFlight(None, replies, [e[0] for e in packer.entries], packer)

    def _wait(self, inflight: _InFlight | None, clock: _Clock) -> None:
        """Wait for every engine's answer, then free the bucket; raise at the first refusal."""
        if inflight is None:
            return
        try:
            with clock("engine_load"):
                wait_futures(inflight.replies, return_when=FIRST_EXCEPTION)
                self._raise_refusals(inflight, REFUSAL_GRACE_S)
        finally:
            if inflight.packer is not None:
                inflight.packer.release()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # a buffer let go of once the engines closed it: the memory can really go

    def _end_sessions(self) -> None:
        if self.source:
            super()._end_sessions()

    def _give_back_segments(self) -> None:
        """After the engines' `end_weight_update` (members wait for the source's word): drop both segments, whose
        memory nobody maps any more, so that it is freed now."""
        if self.peers:
            self.peers.announce(None)
        self._release_segments()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # CUDA IPC memory a consumer had open is freed here, once it closed it

    def _release_segments(self) -> None:
        for segment in self._segments:
            segment.release()

    def close(self) -> None:
        """Let go of the segments (their files go now) and stop the HTTP thread (there is no group to leave)."""
        self._connected = False
        self._release_segments()
        super().close()


def bucket_entries(entries: Sequence[tuple[str, torch.dtype, list[int], int, int]]) -> list[BucketEntry]:
    """A packer's (name, dtype, shape, start, end) rows as `BucketEntry`s."""
    return [BucketEntry(name, dtype, tuple(shape), start, end) for name, dtype, shape, start, end in entries]
