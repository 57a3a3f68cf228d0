"""A rollout pool on its own, without actors: for the commands that only generate (`userrl rollout`, `userrl eval`).

`standalone_pool(cfg, model_dir, log_dir)` starts Ray (or joins `run.ray_address`), places `rollout.num_engines`
engines, yields the started `RolloutPool` and removes the placement group afterwards. `user_simulator(cfg, gyms)`
builds the shared simulator when one of the gyms needs it (None otherwise).
"""

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from userrl_megatron.config.schema import RootConfig
    from userrl_megatron.fleet.pool import RolloutPool


@contextlib.asynccontextmanager
async def standalone_pool(cfg: "RootConfig", model_dir: str, log_dir: Path) -> AsyncIterator["RolloutPool"]:
    """The engine pool of `cfg.rollout` serving `model_dir`, started and, on exit, stopped."""
    import torch

    from userrl_megatron.fleet.placement import create_placement, plan_bundles, start_ray
    from userrl_megatron.fleet.pool import RolloutPool

    start_ray(cfg.run, num_cpus=max(os.cpu_count() or 1, cfg.rollout.num_engines))
    engines_only = dataclasses.replace(cfg.megatron, nnodes=1, devices_per_node=0)  # no actor ranks here
    placement = create_placement(plan_bundles(engines_only, cfg.rollout, use_gpu=torch.cuda.is_available()))
    try:
        async with RolloutPool(cfg.rollout, model_dir, cfg.model.dtype, placement, log_dir) as pool:
            yield pool
    finally:
        from ray.util import remove_placement_group

        remove_placement_group(placement.group)


@contextlib.asynccontextmanager
async def user_simulator(cfg: "RootConfig", gym_names: Iterable[str]) -> AsyncIterator[Any]:
    """The user simulator of `cfg.user_sim` when one of `gym_names` needs it, else None; closed on exit."""
    from gyms.base import gym_spec

    if not any(gym_spec(name).needs_user_sim for name in set(gym_names)):
        yield None
        return
    from gyms.user_sim import UserSimulator

    sim = UserSimulator(cfg.user_sim)  # a missing API key fails here, before anything starts
    try:
        yield sim
    finally:
        await sim.close()
