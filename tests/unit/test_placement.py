import pytest

from userrl_megatron.config import MegatronConfig, RolloutConfig
from userrl_megatron.config.gyms import UserSimEnginesConfig
from userrl_megatron.fleet.placement import (
    COLOCATED_ACTOR_SHARE,
    COLOCATED_ENGINE_SHARE,
    BundlePlan,
    Placement,
    PlacementError,
    RunShape,
    Slot,
    _check_capacity,
    plan_bundles,
    run_shape,
)


def test_cpu_plan_gives_every_rank_and_engine_a_bundle() -> None:
    plan = plan_bundles(MegatronConfig(devices_per_node=2), RolloutConfig(num_engines=2), use_gpu=False)
    assert plan.bundles == [{"CPU": 1.0}] * 4
    assert plan.actor_bundles == [0, 1] and plan.engine_bundles == [2, 3]


def test_disaggregated_gpu_plan_puts_engines_after_actors() -> None:
    m = MegatronConfig(nnodes=2, devices_per_node=8, tensor_model_parallel_size=8)
    plan = plan_bundles(m, RolloutConfig(num_engines=4, engine_tp=2), use_gpu=True)
    assert len(plan.bundles) == 16 + 8
    assert plan.actor_bundles == list(range(16))
    assert plan.engine_bundles == [16, 18, 20, 22]  # each engine's first GPU
    assert plan.actor_resources == {"GPU": 1.0, "CPU": 1.0}


def test_colocated_gpu_plan_shares_bundles() -> None:
    m = MegatronConfig(devices_per_node=8, tensor_model_parallel_size=2)
    plan = plan_bundles(m, RolloutConfig(num_engines=8, engine_tp=1, colocate=True), use_gpu=True)
    assert len(plan.bundles) == 8
    assert plan.engine_bundles == list(range(8)) and plan.actor_bundles == list(range(8))
    assert plan.actor_resources["GPU"] + plan.engine_resources["GPU"] <= 1.0
    assert (
        plan.actor_resources["GPU"],
        plan.engine_resources["GPU"],
    ) == (COLOCATED_ACTOR_SHARE, COLOCATED_ENGINE_SHARE)


def _placement(plan: BundlePlan, gpus_per_node: int) -> Placement:
    """A placement whose bundle i is GPU i % gpus_per_node of node i // gpus_per_node (as probed)."""
    slots = [
        Slot(
            i, i // gpus_per_node, f"n{i // gpus_per_node}", f"10.0.0.{i // gpus_per_node + 1}", str(i % gpus_per_node)
        )
        for i in range(len(plan.bundles))
    ]
    return Placement(group=None, plan=plan, slots=slots, driver_node_id="n0")


def test_the_run_shape_counts_the_user_simulators_gpus() -> None:
    """The policy's GPUs (shared when colocated, added when not) and the simulator engines' own, on whole nodes."""
    m = MegatronConfig(nnodes=2, devices_per_node=8, tensor_model_parallel_size=8)
    colocated = RolloutConfig(num_engines=4, engine_tp=4, colocate=True)
    simulator = UserSimEnginesConfig(model="/models/Qwen3-32B", num_engines=4, engine_tp=2)
    shape = run_shape(m, colocated, simulator)
    assert shape == RunShape(policy_gpus=16, simulator_gpus=8, per_node=8)
    assert (shape.gpus, shape.nodes) == (24, 3)
    assert run_shape(m, colocated, UserSimEnginesConfig(num_engines=4, engine_tp=2)) == RunShape(16, 0, 8)  # no model
    disaggregated = RolloutConfig(num_engines=1, engine_tp=2)
    assert run_shape(m, disaggregated, UserSimEnginesConfig(model="m", engine_tp=2)).nodes == 3  # 16 + 2 + 2 GPUs


def test_each_engine_gets_all_its_gpus_on_its_node() -> None:
    """Engine e of TP4, colocated on two 8-GPU nodes: the GPUs of slots 4e..4e+3, counted on their node (issue 27,
    item 2: the engine process saw only the one GPU of its Ray actor's bundle)."""
    m = MegatronConfig(nnodes=2, devices_per_node=8, tensor_model_parallel_size=8)
    placement = _placement(plan_bundles(m, RolloutConfig(num_engines=4, engine_tp=4, colocate=True), True), 8)
    parts = [placement.engine_parts(e) for e in range(4)]
    assert [[(p.node_rank, p.slot.node, p.gpus) for p in engine] for engine in parts] == [
        [(0, 0, ["0", "1", "2", "3"])],
        [(0, 0, ["4", "5", "6", "7"])],
        [(0, 1, ["0", "1", "2", "3"])],
        [(0, 1, ["4", "5", "6", "7"])],
    ]
    assert [placement.local_rank(r) for r in range(16)] == [*range(8), *range(8)]


def test_an_engine_wider_than_a_node_has_a_part_per_node() -> None:
    m = MegatronConfig(nnodes=2, devices_per_node=8, tensor_model_parallel_size=8)
    placement = _placement(plan_bundles(m, RolloutConfig(num_engines=1, engine_tp=16, colocate=True), True), 8)
    [leader, follower] = placement.engine_parts(0)
    assert (leader.node_rank, leader.slot.bundle, leader.gpus) == (0, 0, [str(g) for g in range(8)])
    assert (follower.node_rank, follower.slot.bundle, follower.slot.ip) == (1, 8, "10.0.0.2")
    assert follower.gpus == [str(g) for g in range(8)]


def test_an_engine_straddling_nodes_unevenly_cannot_be_placed() -> None:
    m = MegatronConfig(nnodes=1, devices_per_node=6)
    placement = _placement(plan_bundles(m, RolloutConfig(num_engines=2, engine_tp=4, colocate=True), True), 6)
    [first, second] = placement.engine_parts(1)  # even parts (2 + 2): SGLang takes it; the config check does not
    assert (first.gpus, second.gpus, second.slot.node) == (["4", "5"], ["0", "1"], 1)
    placement = _placement(plan_bundles(m, RolloutConfig(num_engines=2, engine_tp=3, colocate=True), True), 4)
    with pytest.raises(
        PlacementError,
        match=r"^engine 1's 3 GPUs straddle nodes unevenly \(1 on node 0, 2 on node 1\): rollout.engine_tp must "
        r"divide the GPUs of a node or be a multiple of them$",
    ):
        placement.engine_parts(1)


def test_a_cluster_too_small_fails_at_once_in_one_line() -> None:
    m = MegatronConfig(nnodes=2, devices_per_node=8, tensor_model_parallel_size=8)
    plan = plan_bundles(m, RolloutConfig(num_engines=4, engine_tp=4, colocate=True), True)
    with pytest.raises(PlacementError) as failure:
        _check_capacity(plan, {"GPU": 8.0, "CPU": 64.0})
    assert str(failure.value) == ("the run needs 16 GPUs (16 bundles of CPU 1, GPU 1) and the Ray cluster has 8")
    _check_capacity(plan, {"GPU": 16.0, "CPU": 16.0})


def test_config_refuses_engines_that_do_not_fit_nodes_and_colocation_without_offload() -> None:
    """Issue 27, item 5: engine TP must fit a node or span whole nodes; a colocated SGLang engine sizes its KV
    cache from the memory free when it starts, which only megatron.offload leaves it."""
    from userrl_megatron.config import load_config
    from userrl_megatron.config.checks import check_config
    from userrl_megatron.config.loader import ConfigError

    model = ["configs/model/qwen3-32b.yaml"]
    base = ["rollout.backend=sglang", "megatron.devices_per_node=8", "megatron.offload=true"]
    # a colocated engine spanning two nodes, beside actor ranks on both (a handle never leaves its GPU)
    two_nodes = [*base, "megatron.nnodes=2", "rollout.engine_tp=16", "rollout.colocate=true"]
    check_config(load_config(model, two_nodes), on_gpu=True)
    check_config(load_config(model, [*base, "rollout.engine_tp=4"]), on_gpu=True)
    with pytest.raises(ConfigError) as failure:
        load_config(model, [*base, "megatron.devices_per_node=6", "rollout.engine_tp=4"])
    assert failure.value.problems == [
        "rollout.engine_tp = 4 must divide megatron.devices_per_node = 6 (the GPUs of a node) or be a multiple of "
        "it: an engine fits in one node or spans whole nodes"
    ]
    colocated = [*base[:2], "rollout.colocate=true", "megatron.offload=false"]
    with pytest.raises(ConfigError) as failure:
        load_config(model, colocated)
    assert failure.value.problems == [
        "rollout.colocate = true with megatron.offload = false: a colocated SGLang engine sizes its KV cache once, "
        "from the GPU memory free when it starts, and only with megatron.offload has the actor left the GPU by "
        "then (rollout.sglang.mem_fraction_static would otherwise lose the actor's share); set megatron.offload = "
        "true"
    ]
    load_config(model, [*colocated, "run.device=cpu"])  # on the CPU (sglang --device cpu): no such pool
    load_config(model, [*colocated, "rollout.sglang.device=cpu"])
    load_config(model, [*colocated, "rollout.backend=embedded"])


def test_the_bring_up_tears_down_what_it_started_and_only_that(monkeypatch: pytest.MonkeyPatch) -> None:
    """`reserve_placement`: the checks and the plan learn whether the run is on GPUs; on exit (after an error too) the
    group is removed and Ray shut down when the block started it; a Ray running before stays."""
    import ray
    import ray.util

    from userrl_megatron.config.schema import RunConfig
    from userrl_megatron.fleet import placement

    events: list[str] = []
    running = [False]

    def start(run: RunConfig, cpus: int) -> bool:
        events.append(f"start {cpus}")
        running[0] = True
        return True

    def create(plan: BundlePlan, timeout_s: float, beside: str) -> Placement:
        events.append(f"reserve {len(plan.bundles)} {timeout_s:g} {beside}")
        return Placement(group="group", plan=plan)

    monkeypatch.setattr(placement, "start_run_ray", start)
    monkeypatch.setattr(placement, "create_placement", create)
    monkeypatch.setattr(ray, "is_initialized", lambda: running[0])
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("shutdown"))
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda group: events.append(f"remove {group}"))
    rollout = RolloutConfig(num_engines=2)

    def plan(on_gpu: bool) -> BundlePlan:
        return plan_bundles(MegatronConfig(), rollout, on_gpu)

    with placement.reserve_placement(RunConfig(), plan, 3, lambda on_gpu: events.append(f"check {on_gpu}"), "x", 9):
        events.append("body")
    assert events == ["start 3", "check True", "reserve 3 9 x", "body", "remove group", "shutdown"]

    events.clear()
    with pytest.raises(PlacementError), placement.reserve_placement(RunConfig(), plan, 3):  # Ray runs: it stays
        raise PlacementError("boom")
    assert events == ["start 3", "reserve 3 300 ", "remove group"]

    events.clear()
    running[0] = False

    def refuse(on_gpu: bool) -> None:
        raise PlacementError("no")

    with pytest.raises(PlacementError), placement.reserve_placement(RunConfig(), plan, 3, refuse):
        pass
    assert events == ["start 3", "shutdown"]  # a failed check reserves nothing and stops the Ray it started
