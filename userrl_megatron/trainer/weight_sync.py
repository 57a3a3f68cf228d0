"""Weight sync coordination: the sync groups with every engine, each push, and the repairs around them.

One sync group per pipeline stage with every engine (`connect`). A sync first restarts (and so repairs) the
engines that died since the last rollout, exactly as a rollout would; pushes (syncs and repairs) never overlap.
A restarted engine gets the current weights through a one-off group before it serves again (`repair`, the
pool's restart hook), and the regular groups are rebuilt at the next sync. Engines that refuse an update
are restarted and the version is pushed to every engine again. The first sync of a run is verified.
"""

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from userrl_megatron.actors.protocol import Actors
from userrl_megatron.config.schema import RootConfig
from userrl_megatron.trainer.handoff import MemoryHandoff, repair_engines
from userrl_megatron.trainer.seams import EngineClient, EnginePool
from userrl_megatron.wire.generation import EngineError

log = logging.getLogger(__name__)
SYNC_GROUP = "userrl_sync"
VERIFY_ROWS = 4


class WeightSync:
    """The trainer's side of weight sync for one run."""

    def __init__(self, cfg: RootConfig, actors: Actors, pool: EnginePool, handoff: MemoryHandoff) -> None:
        self.cfg, self.actors, self.pool, self.handoff = cfg, actors, pool, handoff
        self.groups: list[str] = []  # weight-sync group names, one per pipeline stage
        self.version = 0  # the weight version the engines hold
        self._generation = itertools.count()
        self._stale = False  # an engine was restarted: rebuild the groups before the next sync
        self._pushing = asyncio.Lock()  # one weight push at a time (sync or repair)
        self._verified = False  # a sync of this run was verified (read back from the engines)
        self._synced = False  # a sync happened: the engines hold the actor's weights, not the HF ones
        self._unreadable: set[str] = set()  # engines whose model cannot read its weights back by name
        if cfg.sync.enabled:
            handoff.refill = self.refill

    @property
    def method(self) -> str:
        """The weight transport: `sync.method`, where "auto" is tensor handles for colocated engines (NCCL refuses
        a group whose ranks share a GPU) and a broadcast over a process group otherwise."""
        if self.cfg.sync.method != "auto":
            return self.cfg.sync.method
        return "tensor" if self.cfg.rollout.colocate else "distributed"

    async def connect(self) -> None:
        """Create this generation's weight senders (and their sync groups) with every engine."""
        engines = [self._endpoint(i, url) for i, url in enumerate(self.pool.urls)]
        prefix = f"{SYNC_GROUP}_g{next(self._generation)}"
        self.groups = await asyncio.to_thread(self.actors.connect_engines, engines, prefix, self.method)

    async def push(self, version: int) -> dict[str, float]:
        """Pause the engines, stream the weights to all of them, flush their caches, resume. The memory order
        around it (colocated: what leaves the GPUs first, what comes back) is `MemoryHandoff`'s."""
        await self.handoff.before_push()  # before a dead engine restarts, too: see `MemoryHandoff.before_push`
        await repair_engines(self.cfg, self.pool, "weight sync")  # dead engines come back first
        refused = None
        async with self._pushing:
            if self._stale:
                await self._reconnect()
            await self.handoff.open_for_push()
            try:
                metrics = await asyncio.to_thread(self.actors.push_weights, self.groups, version)
            except Exception as e:  # any other failure ends the run with the engines still paused
                refused = getattr(getattr(e, "cause", e), "urls", None)
                if not refused:
                    raise
        if refused:  # outside the lock: the restarts' repair hook pushes too
            metrics = await self._replace_refusing(refused, version)
        await self.pool.flush_cache()
        await self.handoff.close_after_push()
        self.version = version
        self._synced = True
        if self.cfg.sync.verify or not self._verified:  # the first sync of a run is always checked
            metrics |= await self._verify()
            self._verified = True
        return metrics

    async def refill(self) -> None:
        """Push the version the engines hold once more: their weight memory came back empty (`MemoryHandoff`)."""
        await self.push(self.version)

    async def repair(self, index: int, client: EngineClient) -> None:
        """Restart hook: give a restarted engine the current weights before it serves again (colocated, with the
        actor's weights brought back for it), and release what the other engines have released (`MemoryHandoff`)."""
        self._stale = True  # the engine is at a new address: rebuild the sync groups before the next sync
        if self.cfg.sync.enabled and self._synced:  # else it already holds the weights the others hold
            engine = [self._endpoint(index, client.base_url)]
            async with self._pushing, self.handoff.actor_weights_for_repair():
                name = f"{SYNC_GROUP}_repair{index}_{next(self._generation)}"
                groups = await asyncio.to_thread(self.actors.connect_engines, engine, name, self.method)
                try:
                    await asyncio.to_thread(self.actors.push_weights, groups, self.version)
                finally:
                    await asyncio.to_thread(self.actors.disconnect_engines, groups)
            log.info("engine %d repaired with weight version %d", index, self.version)
        await self.handoff.match_released(client)

    async def disconnect(self) -> None:
        await asyncio.to_thread(self.actors.disconnect_engines, self.groups)

    def _endpoint(self, index: int, url: str) -> dict[str, Any]:
        """Engine `index` for a weight sender: its URL, TP size, the device of its first TP rank in the placement's
        order (colocated engines start at device 0, disaggregated ones after the actor's devices), key, checkpoint
        and backend (the payload format of tensor handles)."""
        tp, m = self.cfg.rollout.engine_tp, self.cfg.megatron
        first = 0 if self.cfg.rollout.colocate else m.nnodes * m.devices_per_node
        return {
            "url": url,
            "tp_size": tp,
            "first_device": first + index * tp,
            "api_key": self.pool.api_key,
            "checkpoint": self.pool.model_path,
            "backend": self.cfg.rollout.backend,
        }

    async def _replace_refusing(self, urls: list[str], version: int) -> dict[str, float]:
        """Engines that refused an update may hold partly overwritten weights (SGLang loads tensor by tensor):
        restart them (the pool's recovery, which runs `repair`), then push this version to every engine again
        over fresh groups, since the others may hold only part of it."""
        log.error("weight sync: engines %s refused the update; restarting them and pushing again", urls)
        await self.pool.restart(urls, self.cfg.rollout.sglang.startup_timeout_s)
        async with self._pushing:
            await self._reconnect()
            return await asyncio.to_thread(self.actors.push_weights, self.groups, version)

    async def _reconnect(self) -> None:
        await self.disconnect()
        for client in self.pool.clients:
            for name in self.groups:
                with contextlib.suppress(Exception):  # a restarted engine never joined the old group
                    await client.destroy_weights_update_group(name)
        await self.connect()
        self._stale = False

    async def _verify(self) -> dict[str, float]:
        """Compare the first rows of sampled tensors on every engine with the trainer's export (a checksum).

        An engine that cannot read a weight of its own checkpoint back by name (SGLang's Qwen3 and Qwen3-MoE, among
        most of its model classes) is not read back; the run says so once, and the trainer/engine log-prob gap of
        every step (`mismatch/*`) is the check left."""
        from userrl_megatron.sync.sender import sample_names

        expected = await asyncio.to_thread(self.actors.weight_checksums, VERIFY_ROWS)
        names, worst, read = sample_names(list(expected)), 0.0, 0
        for client in self.pool.clients:
            if client.base_url in self._unreadable:
                continue
            for i, name in enumerate(names):  # SGLang's read-back converts whole tensors: a sample
                try:
                    rows = await client.get_weights_by_name(name, truncate_size=VERIFY_ROWS)
                except EngineError as e:
                    if i > 0:  # it read the first one back: this is a failure, not a missing route
                        raise
                    self._say_unreadable(client.base_url, name, e)
                    break
                worst = max(worst, abs(_nested_sum(rows) - expected[name]) / max(1.0, abs(expected[name])))
            else:
                read += 1
        if worst > 1e-5:
            raise RuntimeError(f"weight sync verify: an engine's weights differ from the trainer's (rel {worst:.3g})")
        return {"sync/verify_max_rel_diff": worst} if read else {}

    def _say_unreadable(self, url: str, name: str, error: Exception) -> None:
        """Once per engine address: its weights cannot be read back, so syncs to it are not verified."""
        self._unreadable.add(url)
        log.warning(
            "weight sync verify: the engine at %s cannot read %s back (%s): its model class has no read-back by "
            "name (SGLang's Qwen3 and Qwen3-MoE have none); its weights are not verified, the trainer/engine "
            "log-prob gap (mismatch/*) is the check",
            url, name, error,
        )  # fmt: skip


def _nested_sum(values: Any) -> float:
    if isinstance(values, list):
        return sum(_nested_sum(v) for v in values)
    return float(values)
