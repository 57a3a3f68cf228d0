from userrl_megatron.config import MegatronConfig, RolloutConfig
from userrl_megatron.trainer.placement import COLOCATED_ACTOR_SHARE, COLOCATED_ENGINE_SHARE, plan_bundles


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
