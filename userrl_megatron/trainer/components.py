"""The running parts of a training run and their choreography: start-up, rollouts, weight sync, shutdown.

Start-up: Ray (local unless `run.ray_address`), one placement group (actor ranks + engines), the Megatron
workers (HF weights loaded on every rank), the engine pool, the user simulator when a gym needs one, and the
weight-sync groups (one per pipeline stage, each with every engine). A restarted engine is repaired before it
serves again: the current weights go to it through a one-off group, and the regular groups are rebuilt at the
next sync. A weight sync first restarts (and so repairs) engines that died since the last rollout, exactly as
a rollout would; weight pushes (syncs and repairs) never overlap. No engine left stops the run.
"""

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from userrl_megatron.config import RootConfig
from userrl_megatron.errors import RunError
from userrl_megatron.trainer.seams import Actors, EngineClient, EnginePool, Runner, Tasks
from userrl_megatron.types import EpisodeGroup, Task

log = logging.getLogger(__name__)
SYNC_GROUP = "userrl_sync"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # what colocated engines release while the actor trains


@dataclass
class Components:
    cfg: RootConfig
    actors: Actors
    pool: EnginePool
    runner: Runner
    tasks: Tasks
    eval_tasks: list[Task]
    user_sim: Any = None  # gyms.user_sim.UserSimulator when a gym needs one
    groups: list[str] = field(default_factory=list)  # weight-sync group names, one per pipeline stage
    version: int = 0  # the weight version the engines hold
    _generation: Any = field(default_factory=itertools.count)
    _stale: bool = False  # an engine was restarted: rebuild the groups before the next sync
    _pushing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one weight push at a time (sync or repair)
    _released: set[str] = field(default_factory=set)  # engine memory tags released and not resumed yet
    _verified: bool = False  # a sync of this run was verified (read back from the engines)
    _synced: bool = False  # a sync happened: the engines hold the actor's weights, not the HF ones
    _gate: asyncio.Semaphore | None = None  # episodes in flight over every group of `rollout_group`

    async def rollout(self, tasks: list[Task], n: int, temperature: float | None = None) -> list[EpisodeGroup]:
        sampling = self.runner.sampling(temperature)
        groups = await self.runner.run_groups(tasks, n, self.pool.session, sampling, self.pool.concurrency)
        self._check_engines()
        return groups

    async def rollout_group(self, task: Task, n: int) -> EpisodeGroup:
        """One training group; every group in flight at once shares the pool's concurrency limit."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.pool.concurrency)
        sampling = self.runner.sampling()
        [group] = await self.runner.run_groups([task], n, self.pool.session, sampling, gate=self._gate)
        self._check_engines()
        return group

    def _check_engines(self) -> None:
        if self.pool.exhausted:
            raise RunError(
                f"every rollout engine failed and was given up after {self.cfg.rollout.engine_max_restarts} "
                f"restarts; engine logs: {self.pool.log_dir}"
            )

    async def enter_training(self) -> None:
        """Colocated mode: the engines pause and free their GPU memory; with `megatron.offload` the actor's state
        returns to the GPU."""
        if self.cfg.rollout.colocate:
            await self._repair_engines("entering training")  # a restarting engine cannot release its memory
            await self.pool.pause()  # also stops health probes: a released engine holds generation
            await self._release_memory(MEMORY_TAGS)
            if self.cfg.megatron.offload:
                await asyncio.to_thread(self.actors.onload)

    async def enter_rollout(self) -> None:
        """Colocated mode: with `megatron.offload` the actor's state goes to host memory; the engines take their
        memory back and resume."""
        if self.cfg.rollout.colocate:
            if self.cfg.megatron.offload:
                await asyncio.to_thread(self.actors.offload)
            await self._resume_memory(MEMORY_TAGS)
            await self.pool.resume()

    @contextlib.asynccontextmanager
    async def actor_on_device(self) -> AsyncIterator[None]:
        """Colocated: a checkpoint save or an HF export reads the actor's state, which is offloaded while the
        engines hold their memory: the engines step aside for it, then take their memory back."""
        if not self.cfg.rollout.colocate:
            yield
            return
        await self.enter_training()
        try:
            yield
        finally:
            await self.enter_rollout()

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Pause the engines, stream the weights to all of them, flush their caches, resume.

        Colocated, the pool is already paused (enter_training): with `megatron.offload` the actor's grads and
        optimizer state leave first, then the engines' weight memory comes back; their KV cache returns in
        enter_rollout, after the actor's weights have moved out too."""
        await self._repair_engines("weight sync")  # dead engines come back first
        colocated = self.cfg.rollout.colocate
        refused = None
        async with self._pushing:
            if self._stale:
                await self._reconnect()
            if not colocated:
                await self.pool.pause()
            if colocated:
                if self.cfg.megatron.offload:  # grads and optimizer state leave before the engines' weights return
                    await asyncio.to_thread(self.actors.offload, False)
                await self._resume_memory(["weights"])
            try:
                metrics = await asyncio.to_thread(self.actors.push_weights, self.groups, version)
            except Exception as e:  # any other failure ends the run with the engines still paused
                refused = getattr(getattr(e, "cause", e), "urls", None)
                if not refused:
                    raise
        if refused:  # outside the lock: the restarts' repair hook pushes too
            metrics = await self._replace_refusing(refused, version)
        await self.pool.flush_cache()
        if not colocated:
            await self.pool.resume()
        self.version = version
        self._synced = True
        if self.cfg.sync.verify or not self._verified:  # the first sync of a run is always checked
            metrics |= await self._verify()
            self._verified = True
        return metrics

    async def _repair_engines(self, what: str) -> None:
        """Restart the engines that died and wait until each is back (or given up)."""
        try:
            await self.pool.repair(self.cfg.rollout.engine_restart_timeout_s)
        except Exception as e:
            self._check_engines()
            raise RunError(f"{what}: the rollout engines could not be brought back ({e})") from e

    async def _replace_refusing(self, urls: list[str], version: int) -> dict[str, float]:
        """Engines that refused an update may hold partly overwritten weights (SGLang loads tensor by tensor):
        restart them (the pool's recovery, which runs `repair`), then push this version to every engine again
        over fresh groups, since the others may hold only part of it."""
        log.error("weight sync: engines %s refused the update; restarting them and pushing again", urls)
        await self.pool.restart(urls, self.cfg.rollout.sglang.startup_timeout_s)
        async with self._pushing:
            await self._reconnect()
            return await asyncio.to_thread(self.actors.push_weights, self.groups, version)

    async def _release_memory(self, tags: Sequence[str]) -> None:
        """Release the tags not released yet; each release pairs with exactly one resume."""
        todo = [t for t in tags if t not in self._released]
        if todo:
            await self._each_engine(lambda c: c.release_memory(todo))
            self._released.update(todo)

    async def _resume_memory(self, tags: Sequence[str]) -> None:
        """Resume only released tags: SGLang 0.5.23's scheduler dies (KeyError) resuming a tag it holds."""
        todo = [t for t in tags if t in self._released]
        if todo:
            await self._each_engine(lambda c: c.resume_memory(todo))
            self._released.difference_update(todo)

    async def _each_engine(self, call: Callable[[EngineClient], Awaitable[Any]]) -> None:
        await asyncio.gather(*(call(c) for c in self.pool.clients))

    def service_metrics(self) -> dict[str, float]:
        """The engines' restarts so far and the user simulator's counters."""
        metrics = {"rollout/engine_restarts": float(self.pool.restarts_total)}
        if self.user_sim is not None:
            metrics |= {f"user_sim/{k}": float(v) for k, v in self.user_sim.metrics().items()}
        return metrics

    async def connect(self) -> None:
        """Create this generation's weight senders (and their sync groups) with every engine."""
        engines = [self._endpoint(i, url) for i, url in enumerate(self.pool.urls)]
        prefix = f"{SYNC_GROUP}_g{next(self._generation)}"
        self.groups = await asyncio.to_thread(self.actors.connect_engines, engines, prefix, self.sync_method)

    def _endpoint(self, index: int, url: str) -> dict[str, Any]:
        """Engine `index` for a weight sender: its URL, TP size and the device of its first TP rank in the
        placement's order (colocated engines start at device 0, disaggregated ones after the actor's devices)."""
        tp, m = self.cfg.rollout.engine_tp, self.cfg.megatron
        first = 0 if self.cfg.rollout.colocate else m.nnodes * m.devices_per_node
        return {"url": url, "tp_size": tp, "first_device": first + index * tp, "api_key": self.pool.api_key}

    @property
    def sync_method(self) -> str:
        """The weight transport: `sync.method`, where "auto" is tensor handles for colocated engines (NCCL refuses
        a group whose ranks share a GPU) and a broadcast over a process group otherwise."""
        if self.cfg.sync.method != "auto":
            return self.cfg.sync.method
        return "tensor" if self.cfg.rollout.colocate else "distributed"

    async def repair(self, index: int, client: EngineClient) -> None:
        """`on_restart` hook: give a restarted engine the current weights before it serves again, and (colocated)
        release the memory the other engines have released, so that every release keeps pairing with one resume."""
        self._stale = True  # the engine is at a new address: rebuild the sync groups before the next sync
        if self.cfg.sync.enabled and self._synced:  # else it already holds the weights the others hold
            engine = [self._endpoint(index, client.base_url)]
            async with self._pushing:
                # Restarted during a colocated rollout, the actor is offloaded: its weights alone come back for
                # the push (the plan's rollout phase leaves room for them), then leave again.
                parked = "weights" in await asyncio.to_thread(self.actors.offloaded)
                if parked:
                    await asyncio.to_thread(self.actors.onload, True)
                name = f"{SYNC_GROUP}_repair{index}_{next(self._generation)}"
                groups = await asyncio.to_thread(self.actors.connect_engines, engine, name, self.sync_method)
                try:
                    await asyncio.to_thread(self.actors.push_weights, groups, self.version)
                finally:
                    await asyncio.to_thread(self.actors.disconnect_engines, groups)
                    if parked:
                        await asyncio.to_thread(self.actors.offload)
            log.info("engine %d repaired with weight version %d", index, self.version)
        if self._released:
            await client.release_memory(sorted(self._released))

    async def _reconnect(self) -> None:
        await asyncio.to_thread(self.actors.disconnect_engines, self.groups)
        for client in self.pool.clients:
            for name in self.groups:
                with contextlib.suppress(Exception):  # a restarted engine never joined the old group
                    await client.destroy_weights_update_group(name)
        await self.connect()
        self._stale = False

    async def _verify(self) -> dict[str, float]:
        """Compare the first rows of sampled tensors on every engine with the trainer's export (a checksum)."""
        from userrl_megatron.sync.sender import sample_names

        expected = await asyncio.to_thread(self.actors.weight_checksums, VERIFY_ROWS)
        worst = 0.0
        for client in self.pool.clients:
            for name in sample_names(list(expected)):  # SGLang's read-back converts whole tensors: a sample
                value = expected[name]
                rows = await client.get_weights_by_name(name, truncate_size=VERIFY_ROWS)
                got = _nested_sum(rows)
                worst = max(worst, abs(got - value) / max(1.0, abs(value)))
        if worst > 1e-5:
            raise RuntimeError(f"weight sync verify: an engine's weights differ from the trainer's (rel {worst:.3g})")
        return {"sync/verify_max_rel_diff": worst}


VERIFY_ROWS = 4


def _nested_sum(values: Any) -> float:
    if isinstance(values, list):
        return sum(_nested_sum(v) for v in values)
    return float(values)


async def bring_up(parts: Components) -> None:
    """Start-up once the actor ranks are built (with their weights, grads and optimizer on the devices): colocated
    with `megatron.offload`, the actor steps aside first, since an engine sizes its KV cache once, from the memory
    free when it starts; then the engines start and the weight-sync groups are made."""
    cfg = parts.cfg
    if cfg.rollout.colocate and cfg.megatron.offload:
        await asyncio.to_thread(parts.actors.offload)
    await parts.pool.start()
    if cfg.sync.enabled:
        await parts.connect()


@contextlib.asynccontextmanager
async def start_components(cfg: RootConfig, run_dir: Path) -> AsyncIterator[Components]:
    """Start every part of the run `cfg` (resolved: `config.resolve.resolve_config`); tear everything down on exit
    (also after an error)."""
    import ray
    import torch

    from gyms.base import gym_spec
    from userrl_megatron.data import load_tasks
    from userrl_megatron.eval.evaluation import eval_tasks as load_eval_tasks
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
    from userrl_megatron.rollout.pool import RolloutPool
    from userrl_megatron.trainer.placement import create_placement, plan_bundles, start_ray
    from userrl_megatron.trainer.task_stream import TaskStream
    from userrl_megatron.trainer.workers import ActorGroup, WorkerSpec

    train_tasks = load_tasks(cfg.gyms.train, "train", cfg.gyms)
    eval_tasks = load_eval_tasks(cfg) if cfg.eval.every_steps else []
    model_dir = resolve_model(cfg.model.path)
    chat = ChatTemplate.from_pretrained(model_dir, cfg.model.tool_format)
    for task in train_tasks[:1] + eval_tasks[:1]:
        chat.present(task.prompt, task.tools)  # a tool format the template cannot show fails here, not mid-run

    user_sim = None
    if any(gym_spec(t.gym).needs_user_sim for t in train_tasks + eval_tasks):
        from gyms.user_sim import UserSimulator

        user_sim = UserSimulator(cfg.user_sim)  # a missing API key fails here, before anything starts

    use_gpu = torch.cuda.is_available() and cfg.run.device != "cpu"
    plan = plan_bundles(cfg.megatron, cfg.rollout, use_gpu)
    started_ray = not ray.is_initialized()
    start_ray(cfg.run, num_cpus=None if use_gpu else max(os.cpu_count() or 1, len(plan.bundles)))
    placement = create_placement(plan)
    actors = pool = None
    try:
        spec = WorkerSpec(cfg.model, cfg.megatron, cfg.algo, cfg.sync, cfg.run.seed)
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, len(plan.actor_bundles))))}
        actors = await asyncio.to_thread(ActorGroup, placement, spec, env)
        runner = EpisodeRunner(cfg.rollout, chat, gym_factory(cfg.gyms, cfg.rollout.max_turns, user_sim))
        runner.routing_replay = cfg.algo.routing_replay == "rollout"
        pool = RolloutPool(cfg.rollout, str(model_dir), cfg.model.dtype, placement, run_dir / "engines")
        parts = Components(cfg, actors, pool, runner, TaskStream(train_tasks, cfg.run.seed), eval_tasks, user_sim)
        pool.on_restart = parts.repair
        await bring_up(parts)
        yield parts
    finally:
        if pool is not None:
            await pool.close()
        if user_sim is not None:
            await user_sim.close()
        if actors is not None:
            actors.shutdown()
        from ray.util import remove_placement_group

        remove_placement_group(placement.group)
        if started_ray:
            ray.shutdown()
