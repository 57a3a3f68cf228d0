"""The parts of a training run and their start-up and teardown (`start_components`).

Start-up: Ray and one placement group for the actor ranks and the engines (`fleet.placement.reserve_placement`, as
every command that places processes), the user simulator when a gym needs one (`fleet.simulator.SimulatorService`:
its engines in a group of their own, or on the policy engines' bundles), the Megatron workers (HF weights loaded on
every rank), the engine pool, and the weight-sync groups (one per pipeline stage, each with every engine). The
colocated memory hand-offs live in `trainer/handoff.py`, weight sync and engine repairs in `trainer/weight_sync.py`.
No engine left stops the run.
"""

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from userrl_megatron.actors.protocol import Actors
from userrl_megatron.config import RootConfig
from userrl_megatron.rollout.admission import GroupGate
from userrl_megatron.trainer.handoff import MemoryHandoff, check_engines
from userrl_megatron.trainer.seams import EnginePool, Runner, Tasks
from userrl_megatron.trainer.weight_sync import WeightSync
from userrl_megatron.types import EpisodeGroup, Task

if TYPE_CHECKING:
    from userrl_megatron.actors.workers import WorkerSpec


@dataclass
class Components:
    """The run's parts, and the two jobs done with them: memory hand-offs (`handoff`) and weight sync
    (`weights`)."""

    cfg: RootConfig
    actors: Actors
    pool: EnginePool
    runner: Runner
    tasks: Tasks
    eval_tasks: list[Task]
    user_sim: Any = None  # gyms.user_sim.UserSimulator when a gym needs one
    sim_pool: EnginePool | None = None  # the simulator's engines, when the run serves them (user_sim.engines)
    handoff: MemoryHandoff = field(init=False)
    weights: WeightSync = field(init=False)
    _gate: GroupGate | None = None  # admits every group of `rollout_group`, whole, under the pool's limit

    def __post_init__(self) -> None:
        # The simulator's engines on the policy engines' GPUs take the same turns (user_sim.engines.placement).
        shared = self.sim_pool if self.cfg.user_sim.engines.shares_policy_engines else None
        self.handoff = MemoryHandoff(self.cfg, self.actors, self.pool, shared)
        self.weights = WeightSync(self.cfg, self.actors, self.pool, self.handoff)

    async def rollout(self, tasks: list[Task], n: int, temperature: float | None = None) -> list[EpisodeGroup]:
        sampling = self.runner.sampling(temperature)
        groups = await self.runner.run_groups(tasks, n, self.pool.session, sampling, self.pool.concurrency)
        check_engines(self.cfg, self.pool)
        return groups

    async def rollout_group(self, task: Task, n: int) -> EpisodeGroup:
        """One training group; every group in flight at once shares the pool's concurrency limit, and a group's
        episodes start together (on the same weights: GRPO compares them with each other)."""
        if self._gate is None:
            self._gate = GroupGate(self.pool.concurrency)
        sampling = self.runner.sampling()
        [group] = await self.runner.run_groups([task], n, self.pool.session, sampling, gate=self._gate)
        check_engines(self.cfg, self.pool)
        return group

    def service_metrics(self) -> dict[str, float]:
        """The engines' restarts and (colocated) memory hand-offs so far, and the user simulator's counters since
        the previous call (a step's own: its calls, failures, retries, tokens, latency percentiles, cache hit rate)."""
        metrics = {"rollout/engine_restarts": float(self.pool.restarts_total)} | self.handoff.metrics()
        if self.sim_pool is not None:
            metrics["user_sim/engine_restarts"] = float(self.sim_pool.restarts_total)
        if self.user_sim is not None:
            metrics |= {f"user_sim/{k}": float(v) for k, v in self.user_sim.metrics(reset=True).items()}
        return metrics


async def bring_up(parts: Components) -> None:
    """Start-up once the actor ranks are built (with their weights, grads and optimizer on the devices): colocated
    with `megatron.offload`, the actor steps aside first, since an engine sizes its KV cache once, from the memory
    free when it starts; then the engines start and the weight-sync groups are made."""
    cfg = parts.cfg
    if cfg.rollout.colocate and cfg.megatron.offload:
        await asyncio.to_thread(parts.actors.offload)
    await parts.pool.start()
    if cfg.sync.enabled:
        await parts.weights.connect()


@contextlib.asynccontextmanager
async def start_components(cfg: RootConfig, run_dir: Path) -> AsyncIterator[Components]:
    """Start every part of the run `cfg` (resolved: `config.resolve.resolve_config`); tear everything down on exit
    (also after an error), the actor first: its weight senders leave their groups while the engines still answer."""
    from userrl_megatron.actors.workers import ActorGroup, thread_env
    from userrl_megatron.data import load_tasks
    from userrl_megatron.eval.evaluation import eval_tasks as load_eval_tasks
    from userrl_megatron.fleet.placement import plan_bundles, reserve_placement
    from userrl_megatron.fleet.pool import RolloutPool
    from userrl_megatron.fleet.simulator import SimulatorService, policy_engine_rollout
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.rollout.chat import ChatTemplate
    from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
    from userrl_megatron.trainer.task_stream import TaskStream

    train_tasks = load_tasks(cfg.gyms.train, "train", cfg.gyms)
    eval_tasks = load_eval_tasks(cfg) if cfg.eval.every_steps else []
    model_dir = resolve_model(cfg.model.path)
    chat = ChatTemplate.from_pretrained(model_dir, cfg.model.tool_format)
    for task in train_tasks[:1] + eval_tasks[:1]:
        chat.present(task.prompt, task.tools)  # a tool format the template cannot show fails here, not mid-run
    sim = SimulatorService(cfg, (t.gym for t in train_tasks + eval_tasks))  # before Ray: a missing key fails here
    bundles = max(len(plan_bundles(cfg.megatron, cfg.rollout, gpu).bundles) for gpu in (False, True))
    plan = functools.partial(plan_bundles, cfg.megatron, cfg.rollout)
    check = functools.partial(check_placed_run, cfg, sim.served)
    with reserve_placement(cfg.run, plan, bundles + sim.engines, check) as placement:
        # The simulator's engines start first: on the policy engines' GPUs (user_sim.engines.placement) they size
        # their KV pool first, and the policy's engines count their share (`policy_engine_rollout`).
        async with sim.running(run_dir / "engines", placement) as user_sim, contextlib.AsyncExitStack() as stack:
            engines = policy_engine_rollout(cfg)
            pool = RolloutPool(engines, str(model_dir), cfg.model.dtype, placement, run_dir / "engines")
            stack.push_async_callback(pool.close)
            actors = await asyncio.to_thread(ActorGroup, placement, worker_spec(cfg), thread_env(placement))
            stack.push_async_callback(asyncio.to_thread, actors.shutdown)
            runner = EpisodeRunner(cfg.rollout, chat, gym_factory(cfg.gyms, cfg.rollout.max_turns, user_sim))
            runner.routing_replay = cfg.algo.routing_replay == "rollout"
            tasks = TaskStream(train_tasks, cfg.run.seed)
            parts = Components(cfg, actors, pool, runner, tasks, eval_tasks, user_sim, sim.pool)
            pool.add_restart_hook(parts.weights.repair)
            await bring_up(parts)
            yield parts


def check_placed_run(cfg: RootConfig, served_simulator: bool, on_gpu: bool) -> None:
    """What `userrl train` could not tell before Ray said where the run goes: the config for GPUs or CPUs, the GPU
    run's interpreters, NCCL, driver and compute modes (`fleet/gpu_preflight.py`), and a cluster with room for the
    simulator's own GPUs, which come on top of the policy's in a group reserved after it."""
    from userrl_megatron.config.checks import check_config
    from userrl_megatron.fleet.gpu_preflight import check_gpu_run
    from userrl_megatron.fleet.placement import check_run_gpus, run_shape

    check_config(cfg, on_gpu=on_gpu)
    if on_gpu:
        check_gpu_run(cfg)
    if on_gpu and served_simulator:
        check_run_gpus(run_shape(cfg.megatron, cfg.rollout, cfg.user_sim.engines))


def worker_spec(cfg: RootConfig, dry: bool = False) -> "WorkerSpec":
    """What every actor rank of the run `cfg` builds (`dry`: records, as `trainer/dry_run.py`)."""
    from userrl_megatron.actors.workers import WorkerSpec

    return WorkerSpec(cfg.model, cfg.megatron, cfg.algo, cfg.sync, cfg.run.seed, dry=dry)
