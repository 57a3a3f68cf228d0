"""A run's processes placed on a cluster without starting any of them: `userrl plan --placement` and the
simulated-cluster tests.

`bring_up(cfg)` runs the trainer's own start-up on the Ray cluster this process is connected to, up to the point
where every process is placed: the placement group (`placement.reserve_placement`, the bring-up of every command),
one `MegatronWorker` per actor rank (`actors.workers.ActorGroup`), the engines' `EngineServer`s
(`fleet.pool.RolloutPool`, followers of multi-node engines and the router included) and the weight-sync groups
(`weight_sync.WeightSync.connect`). The workers and engine servers run dry (`WorkerSpec.dry`, `EngineLaunch.dry`):
the same code until they would initialise torch.distributed and CUDA or launch a server, where they record what
they would run instead.

`simulated_cluster(nodes, gpus_per_node)` is Ray's multi-node test cluster on this machine: one raylet per node,
each declaring its GPUs (none exist; nothing touches CUDA). Node 0, the head, has this machine's address and
runs the driver; node k listens on 127.0.0.(k + 1), so every node has an address of its own.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from userrl_megatron.actors.workers import RankLaunch, SyncRole
from userrl_megatron.config.resolve import resolve_config
from userrl_megatron.config.schema import MegatronConfig, RolloutConfig, RootConfig, RunConfig
from userrl_megatron.fleet.launch import ProcessLaunch
from userrl_megatron.fleet.placement import (
    BundlePlan,
    Placement,
    ip_key,
    plan_bundles,
    ray_environment,
    ray_session,
    reserve_placement,
    run_shape,
    start_ray,
)
from userrl_megatron.fleet.pool import EngineProcess
from userrl_megatron.rollout.admission import GroupGate
from userrl_megatron.types import EpisodeGroup, SamplingParams, Task

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 600.0  # the simulated cluster is sized for the run: only a hang waits this long


@dataclass
class BringUp:
    """What every process of a run would run, and where."""

    nodes: list[str]  # IPs of the driver's node (node 0) and of every node holding a process, then by IP
    ranks: list[RankLaunch]  # actor ranks, in rank order
    engines: list[EngineProcess]  # engine processes, engine by engine, node rank 0 first
    sync: list[SyncRole] = field(default_factory=list)  # every rank's part in every weight-sync group
    router: ProcessLaunch | None = None  # sglang-router on the driver's node (rollout.router: sglang)
    simulator: list[EngineProcess] = field(default_factory=list)  # the user simulator's engines (user_sim.engines)
    simulator_router: ProcessLaunch | None = None  # sglang-router in front of several simulator engines


def cluster_shape(cfg: RootConfig) -> tuple[int, int]:
    """(nodes, GPUs per node) of the smallest cluster of `megatron.devices_per_node`-GPU nodes the run fits, the
    user simulator's engines included (`fleet.placement.run_shape`)."""
    shape = run_shape(cfg.megatron, cfg.rollout, cfg.user_sim.engines)
    return shape.nodes, shape.per_node


@contextlib.contextmanager
def simulated_cluster(nodes: int, gpus_per_node: int) -> Iterator[list[str]]:
    """Ray's multi-node test cluster with `nodes` nodes of `gpus_per_node` GPUs each, this process connected as
    its driver; yields the nodes' IPs (head first) and takes everything down on exit."""
    from ray.cluster_utils import Cluster

    ray_environment()
    node_args = {"num_cpus": gpus_per_node, "num_gpus": gpus_per_node, "object_store_memory": 80 * 2**20}
    # No idle workers started ahead of need: every process here is one the run asked for.
    system = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args, "include_dashboard": False, "_system_config": system}
    )
    try:
        assert cluster.head_node is not None  # initialize_head=True
        head = cluster.head_node.node_ip_address
        others = [f"127.0.0.{k}" for k in range(2, 256) if f"127.0.0.{k}" != head][: nodes - 1]
        for ip in others:
            cluster.add_node(**node_args, node_ip_address=ip)
        with ray_session():
            start_ray(RunConfig(ray_address=cluster.address), log_to_driver=False)
            yield [head, *others]
    finally:
        cluster.shutdown()


class NoRollouts:
    """Runner and task stream of a dry start, which places processes and runs no episode."""

    def sampling(self, temperature: float | None = None) -> SamplingParams | None:
        raise RuntimeError("a dry start runs no episode")

    async def run_groups(self, *args: Any, gate: GroupGate | None = None) -> list[EpisodeGroup]:
        raise RuntimeError("a dry start runs no episode")

    def next(self, count: int) -> list[Task]:
        raise RuntimeError("a dry start draws no task")

    def state(self, carried: Sequence[Task] = ()) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        return None


def bring_up(cfg: RootConfig) -> BringUp:
    """Place every process of `cfg` on the connected Ray cluster, dry (see the module docstring); everything
    placed is removed again before this returns. A layout that cannot be placed raises a UserError (one line)."""
    from userrl_megatron.fleet.placement import check_run_gpus

    shape = run_shape(cfg.megatron, cfg.rollout, cfg.user_sim.engines)
    with reserve_placement(
        cfg.run, on_gpus(cfg.megatron, cfg.rollout), check=lambda _: check_run_gpus(shape), timeout_s=RESERVE_TIMEOUT_S
    ) as placement:
        return asyncio.run(_place(resolve_config(cfg), placement))


def on_gpus(megatron: MegatronConfig, rollout: RolloutConfig) -> Callable[[bool], BundlePlan]:
    """The bundles of a dry start: on GPUs, whatever `run.device` says (the simulated cluster's nodes have them)."""
    return lambda _: plan_bundles(megatron, rollout, use_gpu=True)


async def _place(cfg: RootConfig, placement: Placement) -> BringUp:
    """The dry part of `trainer.components.start_components`: actor ranks, engines, weight-sync groups."""
    from userrl_megatron.actors.workers import ActorGroup
    from userrl_megatron.fleet.pool import RolloutPool
    from userrl_megatron.fleet.simulator import policy_engine_rollout
    from userrl_megatron.trainer.components import Components, worker_spec

    actors = pool = None
    try:
        spec = worker_spec(cfg, dry=True)
        pool = RolloutPool(policy_engine_rollout(cfg), cfg.model.path, cfg.model.dtype, placement, dry=True)
        pool.check_placement()  # an engine that cannot be placed fails before anything starts
        actors = await asyncio.to_thread(ActorGroup, placement, spec)
        parts = Components(cfg, actors, pool, NoRollouts(), NoRollouts(), [])
        await pool.start()
        if cfg.sync.enabled:
            await parts.weights.connect()
        ranks = await asyncio.to_thread(actors.launches)
        roles = await asyncio.to_thread(actors.sync_roles)
        sim = await _place_simulator(cfg, placement) if cfg.user_sim.engines.model else ([], None)
        simulator, simulator_router = sim
        nodes = _nodes(placement, [slot.ip for slot in placement.slots] + [e.ip for e in simulator])
        engines = await pool.launch_records()
        return BringUp(nodes, ranks, engines, roles, pool.router_launch, simulator, simulator_router)
    finally:
        if pool is not None:
            await pool.close()
        if actors is not None:
            actors.shutdown()


def _nodes(placement: Placement, ips: list[str]) -> list[str]:
    """The driver's node first, then the nodes of `ips` in IP order: the run's two placement groups (the policy's,
    the user simulator's) are reserved apart, so either may leave out the driver's node."""
    import ray

    driver = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == placement.driver_node_id)
    return [driver, *sorted(set(ips) - {driver}, key=ip_key)]


async def _place_simulator(cfg: RootConfig, policy: Placement) -> tuple[list[EngineProcess], ProcessLaunch | None]:
    """The user simulator's engines, dry, in a placement group of their own or on the bundles of the policy's
    engines (`user_sim.engines.placement`, as `fleet.simulator.simulator_pool`), and their router (several
    engines)."""
    from userrl_megatron.fleet.placement import shared_placement
    from userrl_megatron.fleet.pool import RolloutPool
    from userrl_megatron.fleet.simulator import simulator_rollout

    rollout = simulator_rollout(cfg)
    with contextlib.ExitStack() as stack:
        if cfg.user_sim.engines.shares_policy_engines:  # the policy's group: removed with the policy's
            placement = shared_placement(policy, rollout.num_engines)
        else:
            engines_only = replace(cfg.megatron, nnodes=1, devices_per_node=0)
            plan = on_gpus(engines_only, rollout)
            placement = stack.enter_context(reserve_placement(cfg.run, plan, timeout_s=RESERVE_TIMEOUT_S))
        dtype = cfg.user_sim.engines.dtype or cfg.model.dtype
        pool = RolloutPool(rollout, cfg.user_sim.engines.model, dtype, placement, dry=True)
        try:
            pool.check_placement()
            await pool.start()
            return await pool.launch_records(), pool.router_launch
        finally:
            await pool.close()


def simulate(cfg: RootConfig) -> BringUp:
    """`bring_up(cfg)` on a simulated cluster of the run's own shape (`cluster_shape`)."""
    with simulated_cluster(*cluster_shape(cfg)):
        return bring_up(cfg)


def format_placement(up: BringUp) -> str:
    """One line per process: node, visible GPUs, then the parallel ranks (actor ranks) or the command line
    (engines, router, the user simulator's engines); then each rank's part in the weight-sync groups; last, each
    node's number and IP."""
    node_of = {ip: i for i, ip in enumerate(up.nodes)}
    lines = []
    for r in up.ranks:
        p = r.parallel
        where = " ".join(f"{d} {p[d + '_rank']}/{p[d]}" for d in ("tp", "pp", "cp", "dp", "ep"))
        lines.append(
            f"node {node_of.get(r.ip, '?')}  rank {r.rank}/{r.world_size}  local rank {r.local_rank}  "
            f"CUDA_VISIBLE_DEVICES={r.visible_devices}  {r.device} {r.backend}  {where}  "
            f"master {r.master_addr}:{r.master_port}"
        )
    spans = {e.engine: 0 for e in up.engines}
    for e in up.engines:
        spans[e.engine] += 1
    for e in up.engines:
        env = " ".join(f"{k}={v}" for k, v in e.launch.env.items())
        part = f" node rank {e.node_rank}/{spans[e.engine]}" if spans[e.engine] > 1 else ""
        lines.append(f"node {node_of.get(e.ip, '?')}  engine {e.engine}{part}  {env}  {' '.join(e.launch.command)}")
    if up.router is not None:
        lines.append(f"node 0  router  {' '.join(up.router.command)}")
    for e in up.simulator:
        env = " ".join(f"{k}={v}" for k, v in e.launch.env.items())
        lines.append(f"node {node_of.get(e.ip, '?')}  user sim engine {e.engine}  {env}  {' '.join(e.launch.command)}")
    if up.simulator_router is not None:
        lines.append(f"node 0  user sim router  {' '.join(up.simulator_router.command)}")
    for s in up.sync:
        if s.method == "tensor" and s.rank != s.members[0]:
            continue  # the group's source speaks for it
        if s.method == "distributed":
            lines.append(
                f"sync {s.group}  rank {s.rank} broadcasts to a group of {s.world_size} "
                f"(engine first ranks {s.engine_ranks})"
            )
        else:
            lines.append(f"sync {s.group}  tensor handles from ranks {s.members}; engine TP ranks map {s.holders}")
    lines.append(
        "nodes  " + ", ".join(f"{i} {ip}" + (" (the driver's)" if i == 0 else "") for i, ip in enumerate(up.nodes))
    )
    return "\n".join(lines)
