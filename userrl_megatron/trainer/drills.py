"""Fault drills (`run.faults`): failures injected at named points of a step, so that tests and operators can
watch the run survive them. The loop calls the hooks of `Drills` at those points; without drills they do
nothing.

- `kill_engine@N`: after step N's rollout, engine 0's server process is killed (SIGKILL, as a crash).
- `kill_engine_in_rollout@N`: the same while step N's episodes run.
- `skip_update@N`: step N trains on nothing (as a step whose episodes were lost).
- `kill_user_sim_in_rollout@N`: while step N's episodes run, the first user-simulator engine the run serves is
  killed (`user_sim.engines`).
- `stop_after_checkpoint@N`: the run stops with an error once step N's checkpoint is written, before the step's
  log line (the worst moment for a crash: the resumed run logs the step from the checkpoint's record).
"""

import logging

from userrl_megatron.errors import RunError
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.trainer.seams import EnginePool

log = logging.getLogger(__name__)


class Drills:
    """The drills of one run, against its engine pool and the user simulator's (`EnginePool.kill_engine_server`)."""

    def __init__(self, faults: list[str], pool: EnginePool, sim_pool: EnginePool | None = None) -> None:
        self.faults, self.pool, self.sim_pool = set(faults), pool, sim_pool

    async def after_rollout(self, step: int) -> None:
        if f"kill_engine@{step}" in self.faults:
            await self._kill_engine(self.pool, 0)

    async def during_rollout(self, step: int) -> None:
        if f"kill_engine_in_rollout@{step}" in self.faults:
            await self._kill_engine(self.pool, 0)
        if f"kill_user_sim_in_rollout@{step}" in self.faults:
            await self._kill_engine(self.sim_pool, 0, "user simulator engine")

    def skips_update(self, step: int) -> bool:
        return f"skip_update@{step}" in self.faults

    async def _kill_engine(self, pool: EnginePool | None, index: int, what: str = "engine") -> None:
        """Kill engine `index`'s server process of `pool` (the pool finds it dead and restarts it)."""
        if pool is None:
            raise RuntimeError(f"fault drill: no {what} to kill (user_sim.engines.model is empty)")
        pid = await pool.kill_engine_server(index)
        log.warning("fault drill: killed %s %d's server (pid %d)", what, index, pid)

    def before_log(self, step: int, checkpoints: CheckpointManager) -> None:
        if f"stop_after_checkpoint@{step}" in self.faults:
            checkpoints.commit(wait=True)
            raise RunError(f"fault drill: stopped after step {step}'s checkpoint, before its log line")
