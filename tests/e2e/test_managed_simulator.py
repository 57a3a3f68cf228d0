"""The user simulator served by the run (`user_sim.engines`): `configs/usersim_cpu.yaml` through the real CLI, with
the simulator's engine killed in the middle of a rollout (`tests/distributed/test_simulator_engines.py` kills one
between calls of the client alone, deterministically).

The policy (SmolLM2-135M) plays IntentionGym; the run starts a frozen SmolLM2-135M engine as the simulated user,
with no endpoint and no network. The kill must cost time, not episodes: the pool restarts the engine, the
simulator client follows it to its new address, and every call that found the engine down waits for that restart
and is retried there (none fails for a connection reason, however slow the restart). Each question is two calls
(the user's answer and the coverage judge's verdict). The tests cut the simulator's replies at 8 tokens to stay
fast, so its calls fail as `bad_json`: counted apart from the engine's death.

The second test puts the simulator's engine on the policy engine's devices (`user_sim.engines.placement:
policy_engines`) in a colocated run: both pools release their memory while the actor trains and take it back
before the next rollout (`trainer.handoff.MemoryHandoff`), and the simulator answers in the rollout after an update.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from gyms.base import parse_action
from tests.support.tiny_run import drill_env, train

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
            "rollout.prompts_per_step=1",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_turns=1",
            "rollout.max_new_tokens_per_turn=64",
            "algo.kl_coef=0",  # no reference pass: the test is about the simulator
            "eval.before_training=false",
            "user_sim.max_tokens=8",
            # user_sim.max_retries stays the config's 1: a call that finds the engine down spends that retry after
            # the restart (it waits for the pool's restart, however long it takes, not for a backoff)
        ],
        env=drill_env("kill_user_sim_in_rollout@2"),
    )
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    episodes = {step: _episodes(tmp_path / "managed" / "rollouts" / f"step_{step}.jsonl") for step in (1, 2)}
    assert [len(episodes[1]), len(episodes[2])] == [4, 4]
    # The simulator's counters are each step's own (sync mode, no evaluation: the calls of its rollout). How many
    # questions reach the simulator depends on sampling (a reply cut at the token limit asks nothing, so a step may
    # ask none; the client alone against a killed engine is tested deterministically in test_simulator_engines.py);
    # that each question is two calls, and that every call ends answered or failed (none still in flight, none
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


def test_simulator_engines_on_the_policy_engines_devices_step_aside_while_the_actor_trains(
    shared_data: Path, tmp_path: Path
) -> None:
    records = train(
        [
            "--config",
            "configs/usersim_cpu.yaml",
            f"gyms.data_dir={shared_data}",
            f"run.output_dir={tmp_path}",
            "run.name=shared",
            "run.total_steps=2",
            "user_sim.engines.placement=policy_engines",
            "rollout.colocate=true",
            "megatron.offload=true",  # the colocated order of every shipped layout: the actor steps aside too
            "rollout.prompts_per_step=1",
            # 16 samples: about three in five of the 135M policy's first replies run past the token limit (most of
            # them past 256 tokens too) and ask nothing, so a step of 4 episodes asks no question about one time in
            # seven; a step of 16, about one time in two thousand.
            "rollout.n_samples_per_prompt=16",
            "logging.rollout_dump_count=16",  # every episode in the dumps
            "rollout.max_turns=1",
            "rollout.max_new_tokens_per_turn=64",
            "algo.kl_coef=0",  # no reference pass: the test is about the hand-offs
            "eval.before_training=false",
            "user_sim.max_tokens=8",
        ]
    )
    assert [r["step"] for r in records] == [1, 2]
    run_dir = tmp_path / "shared"
    episodes = {step: _episodes(run_dir / "rollouts" / f"step_{step}.jsonl") for step in (1, 2)}
    assert [len(episodes[1]), len(episodes[2])] == [16, 16]
    # Both steps trained (every group trains, `algo.drop_equal_score_groups: false`), so both pools released their
    # memory for each update and took it back before the step ended. Run totals: the first hand-off comes before
    # step 1, when the actor holds the devices to look for a checkpoint to resume.
    assert all("timing/train" in r for r in records)
    for pool in ("rollout", "user_sim"):
        assert [(r[f"{pool}/memory_releases"], r[f"{pool}/memory_resumes"]) for r in records] == [(2, 2), (3, 3)]
    # The simulator's engine says so itself: its KV cache and CUDA graphs, never its weights, released four times
    # (the last as the run ends, for its final checkpoint and HF export: nothing resumes after it) and resumed three
    # times.
    sim_log = (run_dir / "engines" / "user_sim" / "engine_0.log").read_text()
    assert (sim_log.count("memory released: "), sim_log.count("memory resumed: ")) == (4, 3)
    assert sim_log.count("memory released: kv_cache, cuda_graph\n") == 4
    assert sim_log.count("memory resumed: kv_cache, cuda_graph\n") == 3
    # Resumed, it answered in both rollouts, the second after an update: every question asked was two calls, and
    # every call got the engine's reply, which cut at 8 tokens is no JSON the gym can read (`bad_json`, or
    # `empty`). A held engine would have let the calls time out; a call failing on the engine would show as
    # another kind. How many questions a step asks depends on sampling (a reply cut at the token limit asks
    # nothing); at least one per step does.
    calls = [sum(map(_asks, episodes[step])) for step in (1, 2)]
    assert [r["user_sim/calls"] for r in records] == calls and min(calls) > 0
    for record in records:
        kinds = {k.rpartition("/")[2] for k, v in record.items() if k.startswith(REPLY_FAILURES) and v}
        assert kinds <= {"bad_json", "empty"}, kinds
        assert record["user_sim/answered"] + record["user_sim/failures"] == record["user_sim/calls"]  # no cache
        assert record["user_sim/completion_tokens"] > 0
    # No infrastructure failure: no engine of either pool died or failed a request.
    assert all(r["rollout/engine_restarts"] == r["user_sim/engine_restarts"] == 0.0 for r in records)
    assert not any(e["finish_reason"] == "engine_error" for step in (1, 2) for e in episodes[step])


REPLY_FAILURES = ("user_sim/failures/", "user_sim/retries/")  # failed calls and retried requests, by kind


def _episodes(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open()]


def _asks(episode: dict[str, Any]) -> int:
    """The simulator calls of the episode's one turn (IntentionGym.act): a question is two (the user's answer and
    the coverage judge's verdict); a reply cut at the token limit has no action, `[finish]` and an empty question
    are answered without a call."""
    actions = [turn["action"] for turn in episode["turns"] if turn["action"] is not None]
    if not actions:
        return 0
    [action] = actions  # rollout.max_turns=1, and the tags format has one action per reply
    tag, payload = parse_action(action)
    return 2 if tag != "finish" and payload else 0
