"""The user simulator served by the run (`user_sim.engines`): `configs/usersim_cpu.yaml` through the real CLI, with
the simulator's engine killed in the middle of a rollout (`tests/distributed/test_simulator_engines.py` kills one
between calls of the client alone, deterministically).

The policy (SmolLM2-135M) plays TelepathyGym; the run starts a frozen SmolLM2-135M engine as the simulated user,
with no endpoint and no network. The kill must cost time, not episodes: the pool restarts the engine, the
simulator client follows it to its new address, and every call that found the engine down waits for that restart
and is retried there (none fails for a connection reason, however slow the restart). A 135M judge rarely writes
the JSON the gym asks for, so most calls fail as `bad_json`: that is the judge's quality, counted apart from the
engine's death.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from gyms.base import parse_action
from tests.support.tiny_run import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_a_killed_simulator_engine_is_restarted_and_no_call_is_lost(shared_data: Path, tmp_path: Path) -> None:
    records = train(
        [
            "--config",
            "configs/usersim_cpu.yaml",
            f"gyms.data_dir={shared_data}",
            f"run.output_dir={tmp_path}",
            "run.name=managed",
            "run.total_steps=2",
            "run.faults=[kill_user_sim_in_rollout@2]",
            "rollout.prompts_per_step=1",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_turns=1",
            "rollout.max_new_tokens_per_turn=64",
            "algo.kl_coef=0",  # no reference pass: the test is about the simulator
            "user_sim.max_tokens=8",
            # user_sim.max_retries stays the config's 1: a call that finds the engine down spends that retry after
            # the restart (it waits for the pool's restart, however long it takes, not for a backoff)
        ]
    )
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    episodes = {step: _episodes(tmp_path / "managed" / "rollouts" / f"step_{step}.jsonl") for step in (1, 2)}
    assert [len(episodes[1]), len(episodes[2])] == [4, 4]
    # The simulator's counters are each step's own (sync mode, no evaluation: the calls of its rollout). How many
    # questions reach the simulator depends on sampling (a reply cut at the token limit asks nothing, so a step may
    # ask none; the client alone against a killed engine is tested deterministically in test_simulator_engines.py);
    # that each question is one call, and that every call ends answered or failed (none still in flight, none
    # dropped), does not.
    assert [r["user_sim/calls"] for r in records] == [sum(map(_asks, episodes[step])) for step in (1, 2)]
    for record in records:
        assert record["user_sim/answered"] + record["user_sim/failures"] == record["user_sim/calls"]  # no cache
    assert (first["user_sim/engine_restarts"], second["user_sim/engine_restarts"]) == (0.0, 1.0)
    # Every call of step 2 came after the kill: those that found the engine down were retried at its new address
    # (`user_sim/retries/connection`, as many as the timing gives), and none was lost to it (nor in step 1).
    assert second.get("user_sim/failures/connection", 0.0) == 0.0
    assert second["rollout/engine_restarts"] == 0.0  # the policy's engines were not touched
    assert not any("cannot reach" in (e.get("error") or "") for e in episodes[2])


def _episodes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open()]


def _asks(episode: dict[str, Any]) -> bool:
    """Whether the episode's one turn put a question or a guess to the simulator (TelepathyGym.act): a reply cut
    at the token limit has no action, `[finish]` and an empty question are answered without a call."""
    actions = [turn["action"] for turn in episode["turns"] if turn["action"] is not None]
    if not actions:
        return False
    [action] = actions  # rollout.max_turns=1, and the tags format has one action per reply
    tag, payload = parse_action(action)
    return tag != "finish" and bool(payload)
