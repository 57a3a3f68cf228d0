"""A rollout pool on its own, without actors: for the commands that only generate (`userrl rollout`, `userrl eval`).

`standalone_pool(cfg, model_dir, log_dir)` places `rollout.num_engines` engines (`placement.reserve_placement`: Ray
started or joined, the group removed afterwards) and yields the started `RolloutPool`. The user simulator of these
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
    from userrl_megatron.fleet.placement import plan_bundles, reserve_placement
    from userrl_megatron.fleet.pool import RolloutPool

    engines_only = dataclasses.replace(cfg.megatron, nnodes=1, devices_per_node=0)  # no actor ranks here
    bundles = max(len(plan_bundles(engines_only, cfg.rollout, gpu).bundles) for gpu in (False, True))

    def check(on_gpu: bool) -> None:
        if on_gpu:
            check_gpu_run(cfg, actors=False)  # the engines' interpreter, the driver, compute modes

    with reserve_placement(
        cfg.run,
        lambda on_gpu: plan_bundles(engines_only, cfg.rollout, on_gpu),
        cpus=bundles,
        check=check,
        beside="the user simulator's engines" if beside_simulator else "",
    ) as placement:
        async with RolloutPool(cfg.rollout, model_dir, cfg.model.dtype, placement, log_dir) as pool:
            yield pool
