"""Where actor ranks and rollout engines run: one Ray placement group, bundles ordered by (node, device).

- CPU mode (this machine): one {CPU: 1} bundle per actor rank and per engine.
- GPU, disaggregated: actor ranks on the first `tp*pp*cp*dp` GPUs, engines on the GPUs after them.
- GPU, colocated: actors and engines share the same GPUs and take turns (engines release memory while actors
  train, actors offload while engines generate); fractional GPU requests let both sit on one bundle.
Actor rank r always lands on the r-th device in (node, device) order, so a TP group is packed on one node; the
driver's node comes first, so rank 0 (the master) and engine 0 sit beside the driver when the group has GPUs
there. A run that serves its user simulator reserves a second group for the simulator's engines (`run_shape`
counts both); Ray may give that one the driver's node. With `user_sim.engines.placement: policy_engines` the
simulator's engines reserve nothing: `shared_placement` puts simulator engine e on policy engine e's bundles.

After the group is reserved every bundle is probed once for its node and the GPU Ray gave it (`Slot`). An
engine's Ray actor sits on the bundle of its first GPU, but its server needs all `engine_tp` of them: the pool
hands it the GPU ids of its slots (`engine_parts`), one part per node it spans.
"""

import contextlib
import ipaddress
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from userrl_megatron.config.gyms import UserSimEnginesConfig
from userrl_megatron.config.schema import MegatronConfig, RolloutConfig, RunConfig
from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)

# Fractions of one GPU bundle requested by each side when colocated (they must sum to <= 1).
COLOCATED_ACTOR_SHARE = 0.4
COLOCATED_ENGINE_SHARE = 0.2
# A user simulator engine's Ray actor on a policy engine's bundle (`shared_placement`): colocated, 0.4 + 0.2 + 0.2.
SHARED_SIMULATOR_SHARE = 0.2


class PlacementError(UserError):
    """The processes of a run cannot be placed on the cluster as the config asks (one line: the reason)."""


@dataclass
class BundlePlan:
    """Bundles to reserve and which bundle each actor rank / engine uses, with the resources each requests."""

    bundles: list[dict[str, float]]
    actor_bundles: list[int]
    engine_bundles: list[int]  # the bundle of each engine's first device
    actor_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)
    engine_width: int = 1  # consecutive bundles (devices) of one engine: engine_tp on GPUs, 1 on CPU


@dataclass(frozen=True)
class Slot:
    """One reserved bundle, as probed: its index in the group, its node and the GPU Ray gave it there."""

    bundle: int
    node: int  # the node's index in placement order (the driver's node first, then by IP)
    node_id: str
    ip: str
    gpu: str | None  # the id Ray assigns the bundle's GPU (a CUDA_VISIBLE_DEVICES entry); None without GPUs


@dataclass(frozen=True)
class EnginePart:
    """The share of one engine on one node: the process that runs there and the GPUs it sees."""

    node_rank: int  # 0: the part that serves HTTP (SGLang's --node-rank)
    slot: Slot  # the part's first slot: its Ray actor sits on this bundle
    gpus: list[str]  # every GPU of the part (empty without GPUs)


@dataclass
class Placement:
    """A ready placement group and the plan it realises (bundle indices already reordered by node/device).

    `slots[i]` is the i-th device in placement order: actor rank r on `slots[plan_slots.actor_bundles[r]]`."""

    group: Any  # ray.util.placement_group.PlacementGroup
    plan: BundlePlan
    slots: list[Slot] = field(default_factory=list)
    logical: BundlePlan | None = None  # the plan in slot indices (None: `plan` is in slot order already)
    driver_node_id: str = ""

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray `.options(...)` pinning actor rank `rank` to its bundle."""
        return self._options(self.plan.actor_bundles[rank], self.plan.actor_resources)

    def engine_options(self, engine: int) -> dict[str, Any]:
        """Ray `.options(...)` pinning engine `engine` to the bundle of its first device."""
        return self._options(self.plan.engine_bundles[engine], self.plan.engine_resources)

    def part_options(self, part: EnginePart) -> dict[str, Any]:
        """Ray `.options(...)` pinning the process of an engine's part to the part's first bundle."""
        return self._options(part.slot.bundle, self.plan.engine_resources)

    def actor_slot(self, rank: int) -> Slot:
        return self.slots[self._logical.actor_bundles[rank]]

    def local_rank(self, rank: int) -> int:
        """Actor rank `rank`'s index among the actor ranks on its node."""
        node = self.actor_slot(rank).node
        return sum(self.actor_slot(r).node == node for r in range(rank))

    def engine_parts(self, engine: int) -> list[EnginePart]:
        """Engine `engine`'s GPUs, one part per node they are on; raises PlacementError if the parts differ in
        size (SGLang gives every node of an engine tp_size / nnodes GPUs)."""
        first = self._logical.engine_bundles[engine]
        slots = self.slots[first : first + self._logical.engine_width]
        nodes: dict[int, list[Slot]] = {}
        for slot in slots:
            nodes.setdefault(slot.node, []).append(slot)
        sizes = [len(s) for s in nodes.values()]
        if len(set(sizes)) > 1:
            spread = ", ".join(f"{len(s)} on node {n}" for n, s in nodes.items())
            raise PlacementError(
                f"engine {engine}'s {len(slots)} GPUs straddle nodes unevenly ({spread}): rollout.engine_tp must "
                "divide the GPUs of a node or be a multiple of them"
            )
        return [
            EnginePart(rank, part[0], [s.gpu for s in part if s.gpu is not None])
            for rank, part in enumerate(nodes.values())
        ]

    @property
    def _logical(self) -> BundlePlan:
        return self.logical or self.plan

    def _options(self, bundle: int, resources: dict[str, float]) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=True,
            ),
        }


def shared_placement(policy: Placement, num_engines: int) -> Placement:
    """The user simulator's engines on the policy engines' GPUs (`user_sim.engines.placement: policy_engines`):
    simulator engine e on the bundles of policy engine e (the same `engine_tp`, checked by the config), in the
    policy's placement group, so the GPUs its server sees are exactly policy engine e's. Nothing more is reserved:
    its Ray actor takes a share of the bundle's GPU (none of a CPU bundle, which the policy engine fills)."""
    if num_engines > len(policy.plan.engine_bundles):
        raise PlacementError(
            f"{num_engines} user simulator engines cannot share the GPUs of {len(policy.plan.engine_bundles)} policy "
            "engines (user_sim.engines.num_engines <= rollout.num_engines)"
        )
    on_gpu = "GPU" in policy.plan.bundles[0]
    share = {"GPU": SHARED_SIMULATOR_SHARE, "CPU": SHARED_SIMULATOR_SHARE} if on_gpu else {"CPU": 0.0}

    def engines_of(plan: BundlePlan) -> BundlePlan:
        return BundlePlan(
            bundles=plan.bundles,
            actor_bundles=[],
            engine_bundles=plan.engine_bundles[:num_engines],
            engine_resources=share,
            engine_width=plan.engine_width,
        )

    logical = engines_of(policy.logical) if policy.logical is not None else None
    return Placement(policy.group, engines_of(policy.plan), policy.slots, logical, policy.driver_node_id)


def plan_bundles(megatron: MegatronConfig, rollout: RolloutConfig, use_gpu: bool) -> BundlePlan:
    """The bundle layout for the actor world and the engines (pure: no Ray)."""
    actor_world = megatron.nnodes * megatron.devices_per_node
    if not use_gpu:
        n = actor_world + rollout.num_engines
        return BundlePlan(
            bundles=[{"CPU": 1.0}] * n,
            actor_bundles=list(range(actor_world)),
            engine_bundles=list(range(actor_world, n)),
            actor_resources={"CPU": 1.0},
            engine_resources={"CPU": 1.0},
        )
    engine_devices = rollout.num_engines * rollout.engine_tp
    if rollout.colocate:
        n, engine_start = max(actor_world, engine_devices), 0
        actor_res = {"GPU": COLOCATED_ACTOR_SHARE, "CPU": COLOCATED_ACTOR_SHARE}
        engine_res = {"GPU": COLOCATED_ENGINE_SHARE, "CPU": COLOCATED_ENGINE_SHARE}
    else:
        n, engine_start = actor_world + engine_devices, actor_world
        actor_res = {"GPU": 1.0, "CPU": 1.0}
        # An engine's Ray actor sits on its first GPU's bundle; its server sees all of the engine's GPUs.
        engine_res = {"GPU": COLOCATED_ENGINE_SHARE, "CPU": COLOCATED_ENGINE_SHARE}
    return BundlePlan(
        bundles=[{"GPU": 1.0, "CPU": 1.0}] * n,
        actor_bundles=list(range(actor_world)),
        engine_bundles=[engine_start + e * rollout.engine_tp for e in range(rollout.num_engines)],
        actor_resources=actor_res,
        engine_resources=engine_res,
        engine_width=rollout.engine_tp,
    )


@dataclass(frozen=True)
class RunShape:
    """The GPUs a run takes on a cluster of `per_node`-GPU nodes (`megatron.devices_per_node`): the policy's (its
    actor ranks and engines, the same GPUs when colocated) and the user simulator's engines (GPUs of their own; none
    when they share the policy engines')."""

    policy_gpus: int
    simulator_gpus: int
    per_node: int

    @property
    def gpus(self) -> int:
        return self.policy_gpus + self.simulator_gpus

    @property
    def nodes(self) -> int:
        """The fewest nodes that hold them all: the placement packs the GPUs node by node."""
        return max(1, -(-self.gpus // max(self.per_node, 1)))


def run_shape(megatron: MegatronConfig, rollout: RolloutConfig, simulator: UserSimEnginesConfig) -> RunShape:
    """The GPUs of the run's placement group and, when the run serves the user simulator
    (`user_sim.engines.model`), those of the simulator's own group (none on the policy engines' GPUs)."""
    policy = len(plan_bundles(megatron, rollout, use_gpu=True).bundles)
    own = simulator.model and not simulator.shares_policy_engines
    served = simulator.num_engines * simulator.engine_tp if own else 0
    return RunShape(policy, served, megatron.devices_per_node)


def check_run_gpus(shape: RunShape) -> None:
    """PlacementError when the Ray cluster has fewer GPUs than the whole run takes. With the user simulator's engines
    the run reserves two placement groups, one after the other; each alone may fit where both do not, and the
    second would wait for GPUs that never come."""
    import ray

    have = ray.cluster_resources().get("GPU", 0.0)
    if shape.simulator_gpus and shape.gpus > have:
        raise PlacementError(
            f"the run needs {shape.gpus} GPUs ({shape.policy_gpus} for the actor and the policy's engines, "
            f"{shape.simulator_gpus} for the user simulator's engines) and the Ray cluster has {have:g}"
        )


# Ray runs its workers 15 nice levels below the process that started it, so that its raylet stays responsive when
# workers saturate a node. A run's workers are the run (actor ranks, engine servers and the servers they launch, which
# inherit it): at nice 15 they get about 3% of a core beside any process at normal priority (a build, a browser, another
# job), and on a busy machine an actor rank took 3 minutes to start. They run at the priority of the process that
# started Ray instead. The environment's own setting wins.
RAY_ENVIRONMENT = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def ray_environment() -> None:
    """Set `RAY_ENVIRONMENT` in this process's environment where it is not set: the Ray instances it starts (their
    raylets inherit it) then use it."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def start_ray(run: RunConfig, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster `run.ray_address` names ("auto": the one this machine runs), passing no resource
    counts; otherwise start a private Ray instance bound to loopback, whatever else runs on the machine (a
    SLURM job's head, the files a killed cluster left in /tmp/ray, a `RAY_ADDRESS` in the environment). A process
    already connected keeps its Ray."""
    import ray

    if ray.is_initialized():
        return
    ray_environment()
    if run.ray_address:
        ray.init(address=run.ray_address, log_to_driver=log_to_driver)
        log.info("connected to Ray at %s: %s", run.ray_address, ray.cluster_resources())
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=log_to_driver,
        )


@contextlib.contextmanager
def ray_session() -> Iterator[None]:
    """Ray's teardown: what the block started (Ray not running at its start, running at its end) is shut down on
    exit; a Ray this process was connected to before stays."""
    import ray

    started = not ray.is_initialized()
    try:
        yield
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def start_run_ray(run: RunConfig, cpus: int) -> bool:
    """Start Ray as `start_ray` does and say whether the run's processes go on GPUs, from the cluster's GPUs
    (`gpu_preflight.run_on_gpus`), never from this process's CUDA: the driver may sit on a CPU-only head node, or see
    no GPU, while the workers have them. A private Ray gets at least `cpus` CPUs (each bundle holds one, and a CPU run
    may have more bundles than cores) and finds this machine's GPUs itself."""
    import ray

    from userrl_megatron.cores import core_count
    from userrl_megatron.fleet.gpu_preflight import run_on_gpus

    start_ray(run, num_cpus=max(core_count(), cpus))
    return run_on_gpus(run.device, ray.cluster_resources())


@contextlib.contextmanager
def reserve_placement(
    run: RunConfig,
    plan: Callable[[bool], BundlePlan],
    cpus: int = 0,
    check: Callable[[bool], None] | None = None,
    beside: str = "",
    timeout_s: float = 300.0,
) -> Iterator[Placement]:
    """The one bring-up of every command that places processes (`userrl train`, `sft`, `rollout`, `eval`, the
    user simulator's engines, and the dry start of `userrl plan --placement`): Ray started for the block or joined
    (`start_run_ray`: `run.ray_address`; a private Ray gets at least `cpus` CPUs), `check(on_gpu)` (what needs to
    know whether the run goes on GPUs), then `plan(on_gpu)`'s bundles reserved (`create_placement`, `beside` and
    `timeout_s` as there). On exit the group is removed and a Ray the block started is shut down."""
    from ray.util import remove_placement_group

    with ray_session():
        on_gpu = start_run_ray(run, cpus)
        if check is not None:
            check(on_gpu)
        placement = create_placement(plan(on_gpu), timeout_s, beside)
        try:
            yield placement
        finally:
            remove_placement_group(placement.group)


def create_placement(plan: BundlePlan, timeout_s: float = 300.0, beside: str = "") -> Placement:
    """Reserve the bundles (PACK), probe each for its node and GPU, and reorder the plan's indices by (node,
    device). A cluster too small for the plan fails at once, one that cannot reserve it in `timeout_s` then.
    `beside` names what this process reserved before (the user simulator's engines of `userrl rollout` and `userrl
    eval`): the plan must fit in what that left free, checked at once, as that reservation is never given back
    during the wait."""
    import ray
    from ray.util.placement_group import placement_group

    _check_capacity(plan, ray.cluster_resources())
    if beside:
        _check_capacity(plan, ray.available_resources(), f" free beside {beside}")
    group = placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        from ray.util import remove_placement_group

        remove_placement_group(group)
        raise PlacementError(
            f"Ray could not reserve {len(plan.bundles)} bundles of {_resources(plan.bundles[0])} within "
            f"{timeout_s:.0f} s; the cluster has {_resources(ray.cluster_resources())}"
        )
    driver = ray.get_runtime_context().get_node_id()
    slots = _probe_slots(group, len(plan.bundles), uses_gpu="GPU" in plan.bundles[0], driver_node_id=driver)
    return Placement(
        group=group,
        plan=BundlePlan(
            bundles=plan.bundles,
            actor_bundles=[slots[i].bundle for i in plan.actor_bundles],
            engine_bundles=[slots[i].bundle for i in plan.engine_bundles],
            actor_resources=plan.actor_resources,
            engine_resources=plan.engine_resources,
            engine_width=plan.engine_width,
        ),
        slots=slots,
        logical=plan,
        driver_node_id=driver,
    )


def _check_capacity(plan: BundlePlan, cluster: dict[str, float], which: str = "") -> None:
    """PlacementError when `cluster` (resource counts, `which` says of what: "" all) lacks the GPUs or CPUs the
    bundles need altogether."""
    for resource in ("GPU", "CPU"):
        need = sum(b.get(resource, 0.0) for b in plan.bundles)
        have = cluster.get(resource, 0.0)
        if need > have:
            raise PlacementError(
                f"the run needs {need:g} {resource}s ({len(plan.bundles)} bundles of {_resources(plan.bundles[0])}) "
                f"and the Ray cluster has {have:g}{which}"
            )


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("GPU", "CPU"))


def _probe_slots(group: Any, n: int, uses_gpu: bool, driver_node_id: str) -> list[Slot]:
    """Slot i (placement order) for each bundle: sorted by node (the driver's first, then by IP and node id) and
    by the GPU id Ray gave the bundle, as probed inside each bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, str, str | None]:
        gpus = ray.get_gpu_ids()
        node = ray.get_runtime_context().get_node_id()
        return ray.util.get_node_ip_address(), node, str(gpus[0]) if gpus else None

    probes = [
        where.options(
            num_gpus=0.01 if uses_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
        ).remote()
        for i in range(n)
    ]
    located = ray.get(probes)

    def node_key(ip: str, node_id: str) -> tuple[bool, tuple[int, int, str], str]:
        return node_id != driver_node_id, ip_key(ip), node_id

    def gpu_key(gpu: str | None) -> tuple[int, str]:
        return (int(gpu), "") if gpu is not None and gpu.isdigit() else (0, gpu or "")

    order = sorted(range(n), key=lambda i: (node_key(*located[i][:2]), gpu_key(located[i][2]), i))
    nodes = sorted({(located[i][0], located[i][1]) for i in range(n)}, key=lambda n: node_key(*n))
    index = {node_id: k for k, (_, node_id) in enumerate(nodes)}
    return [Slot(i, index[located[i][1]], located[i][1], located[i][0], located[i][2]) for i in order]


def ip_key(ip: str) -> tuple[int, int, str]:
    """IPs in numeric order (127.0.0.10 after 127.0.0.9), v4 before v6, names last."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return 9, 0, ip
    return address.version, int(address), ""
