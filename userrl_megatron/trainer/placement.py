"""Where actor ranks and rollout engines run: one Ray placement group, bundles ordered by (node, device).

- CPU mode (this machine): one {CPU: 1} bundle per actor rank and per engine.
- GPU, disaggregated: actor ranks on the first `tp*pp*cp*dp` GPUs, engines on the GPUs after them.
- GPU, colocated: actors and engines share the same GPUs and take turns (engines release memory while actors
  train, actors offload while engines generate); fractional GPU requests let both sit on one bundle.
Actor rank r always lands on the r-th device in (node, device) order, so a TP group is packed on one node.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from userrl_megatron.config.schema import MegatronConfig, RolloutConfig, RunConfig

log = logging.getLogger(__name__)

# Fractions of one GPU bundle requested by each side when colocated (they must sum to <= 1).
COLOCATED_ACTOR_SHARE = 0.4
COLOCATED_ENGINE_SHARE = 0.2


@dataclass
class BundlePlan:
    """Bundles to reserve and which bundle each actor rank / engine uses, with the resources each requests."""

    bundles: list[dict[str, float]]
    actor_bundles: list[int]
    engine_bundles: list[int]  # the bundle of each engine's first device
    actor_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class Placement:
    """A ready placement group and the plan it realises (bundle indices already reordered by node/device)."""

    group: Any  # ray.util.placement_group.PlacementGroup
    plan: BundlePlan

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray `.options(...)` pinning actor rank `rank` to its bundle."""
        return self._options(self.plan.actor_bundles[rank], self.plan.actor_resources)

    def engine_options(self, engine: int) -> dict[str, Any]:
        """Ray `.options(...)` pinning engine `engine` to the bundle of its first device."""
        return self._options(self.plan.engine_bundles[engine], self.plan.engine_resources)

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
        # An engine's Ray actor sits on its first GPU's bundle; the server uses the following GPUs itself.
        engine_res = {"GPU": COLOCATED_ENGINE_SHARE, "CPU": COLOCATED_ENGINE_SHARE}
    return BundlePlan(
        bundles=[{"GPU": 1.0, "CPU": 1.0}] * n,
        actor_bundles=list(range(actor_world)),
        engine_bundles=[engine_start + e * rollout.engine_tp for e in range(rollout.num_engines)],
        actor_resources=actor_res,
        engine_resources=engine_res,
    )


def start_ray(run: RunConfig, num_cpus: int | None = None) -> None:
    """Join the cluster `run.ray_address` names ("auto": the one this machine runs), passing no resource
    counts; otherwise start a private Ray instance bound to loopback, whatever else runs on the machine (a
    SLURM job's head, the files a killed cluster left in /tmp/ray, a `RAY_ADDRESS` in the environment)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if run.ray_address:
        ray.init(address=run.ray_address, log_to_driver=True)
        log.info("connected to Ray at %s: %s", run.ray_address, ray.cluster_resources())
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
        )


def create_placement(plan: BundlePlan, timeout_s: float = 300.0) -> Placement:
    """Reserve the bundles (PACK) and reorder the plan's indices by (node, device) of the reserved bundles."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(plan.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(
            f"Ray could not reserve {len(plan.bundles)} bundles {plan.bundles[0]} within {timeout_s:.0f} s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    order = _bundle_order(group, len(plan.bundles), uses_gpu="GPU" in plan.bundles[0])
    return Placement(
        group=group,
        plan=BundlePlan(
            bundles=plan.bundles,
            actor_bundles=[order[i] for i in plan.actor_bundles],
            engine_bundles=[order[i] for i in plan.engine_bundles],
            actor_resources=plan.actor_resources,
            engine_resources=plan.engine_resources,
        ),
    )


def _bundle_order(group: Any, n: int, uses_gpu: bool) -> list[int]:
    """Logical slot i -> bundle index, sorted by (node IP, first GPU id) as probed inside each bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, int]:
        gpus = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpus[0]) if gpus else 0

    probes = [
        where.options(
            num_gpus=0.01 if uses_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
        ).remote()
        for i in range(n)
    ]
    located = ray.get(probes)
    return sorted(range(n), key=lambda i: (located[i], i))
