import asyncio

import pytest

from gyms import make_gym
from gyms.echo.env import echo_record
from gyms.echo.settings import EchoGymConfig
from userrl_megatron.config import load_config
from userrl_megatron.data import load_tasks


def _play(task: object, actions: list[str], config: EchoGymConfig | None = None) -> list[tuple[float, bool]]:
    async def go() -> list[tuple[float, bool]]:
        gym = make_gym("echo", task, config)
        await gym.reset()
        out = []
        for action in actions:
            result = await gym.step(action)
            out.append((result.reward, result.done))
        await gym.close()
        return out

    return asyncio.run(go())


def test_turn_reward_is_the_share_of_the_requested_letter() -> None:
    record = {"id": "echo-x-0", "targets": ["a", "b", "a"]}
    results = _play(record, ["[action] a", "[action]  bab ", "[action] "])
    assert results == [(1.0, False), (pytest.approx(2 / 3, abs=1e-4), False), (0.0, True)]


def test_finish_and_untagged_replies() -> None:
    record = {"id": "echo-x-1", "targets": ["b", "b"]}
    assert _play(record, ["b", "[finish]"]) == [(1.0, False), (0.0, True)]


def test_procedural_source_is_seeded_and_split_disjoint() -> None:
    cfg = load_config(overrides=["gyms.echo.alphabet=xyz", "gyms.echo.turns=2", "gyms.echo.same_letter=false"]).gyms
    train, again, test = (
        load_tasks(["echo-procedural"], "train", cfg),
        load_tasks(["echo-procedural"], "train", cfg),
        load_tasks(["echo-procedural"], "test", cfg),
    )
    assert len(train) == cfg.echo.tasks_per_split
    assert [t.metadata["record"] for t in train] == [t.metadata["record"] for t in again]
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in test})
    targets = [letter for t in train for letter in t.metadata["record"]["targets"]]
    assert set(targets) == {"x", "y", "z"} and all(len(t.metadata["record"]["targets"]) == 2 for t in train)
    task = train[0]
    assert task.prompt[-1].content == f"Say {task.metadata['record']['targets'][0]}."
    assert task.metadata["reply_without_tool_call"] == "action" and task.tools == []


def test_task_ids_resolve_and_bad_ids_say_why() -> None:
    config = EchoGymConfig(alphabet="q", turns=2)
    assert echo_record("echo-train-3", config) == {"id": "echo-train-3", "targets": ["q", "q"]}
    assert _play("echo-test-9", ["[action] q", "[action] qq"], config) == [(1.0, False), (1.0, True)]
    with pytest.raises(KeyError, match="ids look like echo-train-12"):
        echo_record("nope", config)


def test_reply_delay_is_log_normal_with_the_configured_median_and_p99() -> None:
    import random

    from gyms.echo.env import reply_delay

    rng = random.Random(0)
    draws = sorted(reply_delay(rng, 0.2, 5.0) for _ in range(20000))
    assert draws[len(draws) // 2] == pytest.approx(0.2, rel=0.05)
    assert draws[int(len(draws) * 0.99)] == pytest.approx(5.0, rel=0.15)
    assert reply_delay(rng, 0.0, 5.0) == 0.0  # no delay by default
    assert reply_delay(random.Random(1), 0.3, 0.3) == 0.3  # p99 = median: a constant delay
