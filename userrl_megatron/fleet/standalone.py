"""A rollout pool on its own, without actors: for the commands that only generate (`userrl rollout`, `userrl eval`).

`standalone_pool(cfg, model_dir, log_dir)` starts Ray (or joins `run.ray_address`), places `rollout.num_engines`
engines, yields the started `RolloutPool` and removes the placement group afterwards. The user simulator of these
commands comes from `fleet/simulator.py`.
"""

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.fleet.pool import RolloutPool


@contextlib.asynccontextmanager
async def standalone_pool(
    cfg: "RootConfig", model_dir: str, log_dir: Path, beside_simulator: bool = False
) -> AsyncIterator["RolloutPool"]:
    """The engine pool of `cfg.rollout` serving `model_dir`, started and, on exit, stopped. `beside_simulator`: this
    process placed the user simulator's engines first (`fleet.simulator.simulator_pool`), so a cluster without room
    for both fails at once rather than after `create_placement`'s wait."""
    from userrl_megatron.fleet.gpu_preflight import check_gpu_run
    from userrl_megatron.fleet.placement import create_placement, plan_bundles, start_run_ray
    from userrl_megatron.fleet.pool import RolloutPool

    engines_only = dataclasses.replace(cfg.megatron, nnodes=1, devices_per_node=0)  # no actor ranks here
    bundles = max(len(plan_bundles(engines_only, cfg.rollout, gpu).bundles) for gpu in (False, True))
    use_gpu = start_run_ray(cfg.run, bundles)  # GPUs from the cluster's resources, not this process's CUDA
    if use_gpu:
        check_gpu_run(cfg, actors=False)  # the engines' interpreter, the driver, compute modes
    plan = plan_bundles(engines_only, cfg.rollout, use_gpu)
    placement = create_placement(plan, beside="the user simulator's engines" if beside_simulator else "")
    try:
        async with RolloutPool(cfg.rollout, model_dir, cfg.model.dtype, placement, log_dir) as pool:
            yield pool
    finally:
        from ray.util import remove_placement_group

        remove_placement_group(placement.group)
