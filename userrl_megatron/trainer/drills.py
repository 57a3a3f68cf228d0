"""Fault drills: failures injected at named points of a step, so that tests can watch the run survive them. The
loop calls the hooks of `Drills` at those points; without drills they do nothing.

Drills are no setting of a run: a test hands the trainer a `Drills` object, or, for a `userrl train` it starts as a
process, names them in the environment variable `USERRL_DRILLS` (comma-separated; `Drills.from_env`).

- `kill_engine@N`: after step N's rollout, engine 0's server process is killed (SIGKILL, as a crash).
- `kill_engine_in_rollout@N`: the same while step N's episodes run.
- `skip_update@N`: step N trains on nothing (as a step whose episodes were lost).
- `kill_user_sim_in_rollout@N`: while step N's episodes run, the first user-simulator engine the run serves is
  killed (`user_sim.engines`).
- `stop_after_checkpoint@N`: the run stops with an error once step N's checkpoint is written, before the step's
  log line (the worst moment for a crash: the resumed run logs the step from the checkpoint's record).
"""

import logging
import os
import re
from collections.abc import Mapping

from userrl_megatron.errors import RunError
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.trainer.seams import EnginePool

log = logging.getLogger(__name__)
DRILLS_ENV = "USERRL_DRILLS"  # set by tests that start `userrl train` as a process
DRILL = re.compile(
    r"(skip_update|kill_engine|kill_engine_in_rollout|kill_user_sim_in_rollout|stop_after_checkpoint)@[1-9][0-9]*"
)


def drills_from(environ: Mapping[str, str]) -> list[str]:
    """The drills `USERRL_DRILLS` names in `environ` (none when unset); RunError for one of another form."""
    named = [d.strip() for d in environ.get(DRILLS_ENV, "").split(",") if d.strip()]
    bad = [d for d in named if not DRILL.fullmatch(d)]
    if bad:
        raise RunError(
            f"{DRILLS_ENV}: {bad} are not of the form skip_update@STEP, kill_engine@STEP, kill_engine_in_rollout@STEP, "
            "kill_user_sim_in_rollout@STEP or stop_after_checkpoint@STEP"
        )
    return named


class Drills:
    """The drills of one run, against its engine pool and the user simulator's (`EnginePool.kill_engine_server`)."""

    def __init__(self, faults: list[str], pool: EnginePool, sim_pool: EnginePool | None = None) -> None:
        self.faults, self.pool, self.sim_pool = set(faults), pool, sim_pool

    @classmethod
    def from_env(cls, pool: EnginePool, sim_pool: EnginePool | None = None) -> "Drills":
        """The drills this process's `USERRL_DRILLS` names: none in a normal run."""
        drills = cls(drills_from(os.environ), pool, sim_pool)
        if drills.faults:
            log.warning("fault drills from %s: %s", DRILLS_ENV, ", ".join(sorted(drills.faults)))
        return drills

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
