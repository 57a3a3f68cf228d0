"""Fault drills fire at their own hook and step only."""

import asyncio

import pytest

from userrl_megatron.errors import RunError
from userrl_megatron.trainer.drills import DRILLS_ENV, Drills, drills_from


class KillablePool:
    """The pool's drill seam (`EnginePool.kill_engine_server`): counts the kills."""

    def __init__(self) -> None:
        self.kills: list[int] = []

    async def kill_engine_server(self, index: int) -> int:
        self.kills.append(index)
        return 4321


def test_each_drill_fires_at_its_hook_and_step() -> None:
    pool = KillablePool()
    drills = Drills(["kill_engine@2", "kill_engine_in_rollout@3", "skip_update@4"], pool)

    async def play() -> list[tuple[int, int, bool]]:
        seen = []
        for step in range(1, 6):
            await drills.during_rollout(step)
            during = len(pool.kills)
            await drills.after_rollout(step)
            seen.append((during, len(pool.kills), drills.skips_update(step)))
        return seen

    assert asyncio.run(play()) == [(0, 0, False), (0, 1, False), (2, 2, False), (2, 2, True), (2, 2, False)]
    assert pool.kills == [0, 0]
    assert not any(Drills([], pool).skips_update(s) for s in range(1, 6))


def test_the_simulator_drill_kills_a_simulator_engine_or_fails_without_one() -> None:
    policy, simulator = KillablePool(), KillablePool()
    asyncio.run(Drills(["kill_user_sim_in_rollout@1"], policy, simulator).during_rollout(1))
    assert (policy.kills, simulator.kills) == ([], [0])
    # Without simulator engines (user_sim.engines.model empty) the drill fails: it never falls back on the policy's.
    with pytest.raises(RuntimeError, match="no user simulator engine to kill"):
        asyncio.run(Drills(["kill_user_sim_in_rollout@1"], policy).during_rollout(1))
    assert policy.kills == []


class Commits:
    """The checkpoint manager's commit, recorded."""

    def __init__(self) -> None:
        self.waits: list[bool] = []

    def commit(self, wait: bool) -> None:
        self.waits.append(wait)


def test_the_stop_drill_commits_step_ns_checkpoint_then_stops_the_run() -> None:
    checkpoints = Commits()
    drills = Drills(["stop_after_checkpoint@2"], KillablePool())
    drills.before_log(1, checkpoints)  # type: ignore[arg-type]
    with pytest.raises(RunError, match="fault drill: stopped after step 2's checkpoint, before its log line"):
        drills.before_log(2, checkpoints)  # type: ignore[arg-type]
    assert checkpoints.waits == [True]  # the background save is on disk before the run stops


def test_drills_come_from_the_environment_only_when_named_there() -> None:
    assert drills_from({}) == [] and drills_from({DRILLS_ENV: ""}) == []
    assert drills_from({DRILLS_ENV: "skip_update@1, kill_engine@2"}) == ["skip_update@1", "kill_engine@2"]
    with pytest.raises(RunError, match=r"\['kill_everything@1', 'skip_update@0'\] are not of the form"):
        drills_from({DRILLS_ENV: "kill_everything@1,skip_update@0"})
