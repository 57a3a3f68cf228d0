"""Episode dumps and rollout statistics on hand-built episodes."""

from pathlib import Path

import pytest

from userrl_megatron.observability.dumps import read_episodes, write_episodes
from userrl_megatron.rollout.summary import rollout_metrics, summarize
from userrl_megatron.types import Episode, Message, Task, Turn


def episode(gym: str, rewards: list[float], finish: str, generated: int = 3, reply: int = 2) -> Episode:
    """Prompt of 4 tokens, then per turn `generated` trained tokens and `reply` environment tokens."""
    e = Episode(task=Task(gym, f"{gym}-1", [Message("user", "go")]), group_id="g", finish_reason=finish)  # type: ignore[arg-type]
    e.append([1, 2, 3, 4], trained=False)
    e.prompt_length = 4
    for i, reward in enumerate(rewards):
        start = len(e.token_ids)
        e.append(list(range(10, 10 + generated)), trained=True, turn=i, logprobs=[-0.5] * generated)
        e.turns.append(Turn(i, start, start + generated, f"t{i}", "[answer] 1", "ok", reward, {"generate_s": 0.25}))
        e.append([7] * reply, trained=False)
    e.metadata.update(episode_id="g-0", duration_s=1.5)
    return e


def test_dump_round_trip(tmp_path: Path) -> None:
    first = episode("function", [0.0, 1.0], "done")
    broken = episode("travel", [0.0], "gym_error")
    broken.metadata["error"] = "RuntimeError: boom"
    path = tmp_path / "rollouts" / "step_3.jsonl"
    assert write_episodes(path, [first], step=3) == 1
    assert write_episodes(path, [broken], step=3) == 1  # appends
    records = read_episodes(path)
    assert [r["gym"] for r in records] == ["function", "travel"]
    assert write_episodes(path, [broken], step=3, replace=True) == 1  # a resumed run's step: its episodes only
    assert [r["gym"] for r in read_episodes(path)] == ["travel"] and sorted(p.name for p in path.parent.iterdir()) == [
        "step_3.jsonl"
    ]
    assert records[0] == {
        "step": 3,
        "episode_id": "g-0",
        "group_id": "g",
        "gym": "function",
        "task_id": "function-1",
        "finish_reason": "done",
        "reward": 1.0,
        "turn_rewards": [0.0, 1.0],
        "prompt_tokens": 4,
        "response_tokens": 10,
        "trained_tokens": 6,
        "weight_version": 0,
        "duration_s": 1.5,
        "prompt": [{"role": "user", "content": "go"}],
        "tools": [],
        "turns": [
            {
                "index": i,
                "tokens": [10, 11, 12],
                "text": f"t{i}",
                "action": "[answer] 1",
                "feedback": "ok",
                "reward": float(i),
                "weight_version": 0,
                "finish_reason": None,
                "generate_s": 0.25,
                "step_s": None,
            }
            for i in range(2)
        ],
    }
    assert records[1]["error"] == "RuntimeError: boom"


def test_summary_and_metrics() -> None:
    episodes = [
        episode("function", [0.0, 1.0], "done"),
        episode("function", [0.0, 0.0, 0.0], "max_turns"),
        episode("travel", [0.5], "truncated", generated=5),
    ]
    rows = summarize(episodes)
    assert [r.gym for r in rows] == ["function", "travel", "all"]
    function, travel, total = rows
    assert (function.episodes, function.reward_mean, function.positive, function.turns_mean) == (2, 0.5, 0.5, 2.5)
    assert (function.generated_tokens, function.response_tokens_mean) == (15, 12.5)
    assert function.finish == {"done": 1, "max_turns": 1}
    assert (travel.generated_tokens, travel.response_tokens_mean) == (5, 7.0)
    assert total.reward_mean == pytest.approx(1.5 / 3)
    metrics = rollout_metrics(episodes)
    assert metrics["rollout/episodes"] == 3.0
    assert metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/finish/done"] == pytest.approx(1 / 3)
    assert metrics["rollout/function/reward_mean"] == 0.5
    assert metrics["rollout/travel/reward_mean"] == 0.5
    assert rollout_metrics([]) == {} and summarize([]) == []


def test_infrastructure_failures_are_counted_not_scored() -> None:
    episodes = [
        episode("function", [1.0], "done"),
        episode("function", [0.0], "engine_error"),
        episode("travel", [0.0, 0.0], "user_sim_error"),
    ]
    function, travel, total = summarize(episodes)
    assert (function.episodes, function.infra_failed, function.reward_mean, function.turns_mean) == (2, 1, 1.0, 1.0)
    assert (travel.episodes, travel.infra_failed) == (1, 1)
    assert (total.infra_failed, total.reward_mean, total.positive) == (2, 1.0, 1.0)
    metrics = rollout_metrics(episodes)
    assert metrics["rollout/infra_failed"] == 2.0 and metrics["rollout/reward_mean"] == 1.0
    assert metrics["rollout/generated_tokens"] == 12.0  # what the engines generated still counts as throughput
    assert "rollout/travel/reward_mean" not in metrics  # no travel episode was scored: no score, not 0
    only_failures = rollout_metrics(episodes[1:])
    assert only_failures["rollout/infra_failed"] == 2.0 and "rollout/reward_mean" not in only_failures
