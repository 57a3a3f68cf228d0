import pytest

from userrl_megatron.config import MegatronConfig, RolloutConfig
from userrl_megatron.trainer.placement import plan_bundles


@pytest.mark.distributed
def test_ray_placement_pins_actors_to_their_bundles() -> None:
    import ray

    from userrl_megatron.config import RunConfig
    from userrl_megatron.trainer.placement import create_placement, start_ray

    start_ray(RunConfig(), num_cpus=3)
    try:
        placement = create_placement(
            plan_bundles(MegatronConfig(devices_per_node=2), RolloutConfig(num_engines=1), use_gpu=False)
        )

        @ray.remote
        class Where:
            def group(self) -> str | None:
                return ray.get_runtime_context().get_placement_group_id()

        actors = [Where.options(**placement.actor_options(r)).remote() for r in range(2)]
        engine = Where.options(**placement.engine_options(0)).remote()
        groups = ray.get([a.group.remote() for a in actors] + [engine.group.remote()])
        assert groups == [placement.group.id.hex()] * 3
        assert sorted(placement.plan.actor_bundles + placement.plan.engine_bundles) == [0, 1, 2]
    finally:
        ray.shutdown()
