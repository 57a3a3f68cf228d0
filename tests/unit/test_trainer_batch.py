"""Batch preparation (filters, masks, advantages), mini-batches and the task stream."""

import pytest

from userrl_megatron.config import AlgoConfig
from userrl_megatron.trainer.batch import bound_staleness, filter_groups, mini_batches, prepare_batch
from userrl_megatron.trainer.task_stream import TaskStream
from userrl_megatron.types import Episode, EpisodeGroup, Message, Task, TrainBatch, Turn

TASK = Task("echo", "t", [Message("user", "hi")])


def episode(group: str, rewards: list[float], finish: str = "done", versions: list[int] | None = None) -> Episode:
    """A prompt of 2 tokens, then per turn 2 generated tokens (of weight version `versions[turn]`, default 0) and 1
    environment token."""
    ep = Episode(task=TASK, group_id=group, finish_reason=finish)  # type: ignore[arg-type]
    ep.append([1, 2], trained=False)
    for t, reward in enumerate(rewards):
        start = len(ep.token_ids)
        ep.append([10 + t, 20 + t], trained=True, turn=t, logprobs=[-0.5, -1.0])
        ep.turns.append(Turn(t, start, start + 2, "x", reward=reward, weight_version=(versions or [0] * 9)[t]))
        ep.append([3], trained=False)
    return ep


def test_prepare_batch_advantages_and_masks() -> None:
    groups = [
        EpisodeGroup("g", TASK, [episode("g", [1.0]), episode("g", [0.0]), episode("g", [0.5], "user_sim_error")])
    ]
    prepared = prepare_batch(groups, AlgoConfig(user_sim_failure="mask", turn_level="Equalized"))
    assert prepared is not None
    # Sum scores 1.0, 0.0, 0.5: mean 0.5, unbiased std 0.5; the masked episode stays in the group statistics.
    z = 0.5 / (0.5 + 1e-6)
    assert prepared.batch.advantages[0] == pytest.approx([0, 0, z, z, 0], abs=1e-6)
    assert prepared.batch.advantages[1] == pytest.approx([0, 0, -z, -z, 0], abs=1e-6)
    assert prepared.batch.loss_mask == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert prepared.batch.rollout_logprobs[0] == [0.0, 0.0, -0.5, -1.0, 0.0]
    assert prepared.metrics["batch/masked_episodes"] == 1.0 and prepared.metrics["batch/trained_tokens"] == 4.0


def test_user_sim_failures_dropped_and_broken_episodes_always_dropped() -> None:
    groups = [
        EpisodeGroup(
            "a", TASK, [episode("a", [1.0]), episode("a", [0.0], "user_sim_error"), episode("a", [1.0], "engine_error")]
        ),
        EpisodeGroup("b", TASK, [episode("b", [], "engine_error")]),
    ]
    kept, metrics = filter_groups(groups, AlgoConfig(user_sim_failure="drop"))
    assert [len(g.episodes) for g in kept] == [1]
    assert metrics == {"batch/dropped_episodes": 3.0, "batch/dropped_groups": 1.0}
    kept, _ = filter_groups(groups, AlgoConfig(user_sim_failure="keep"))
    assert [e.finish_reason for e in kept[0].episodes] == ["done", "user_sim_error"]


def test_equal_score_groups_dropped_on_request_and_nothing_left_is_none() -> None:
    groups = [EpisodeGroup("g", TASK, [episode("g", [0.5]), episode("g", [0.5])])]
    assert prepare_batch(groups, AlgoConfig(drop_equal_score_groups=True)) is None
    assert prepare_batch(groups, AlgoConfig()) is not None


def test_mini_batches_partition_the_episodes() -> None:
    batch = TrainBatch([[i] for i in range(7)], [[1]] * 7, [[float(i)] for i in range(7)], old_logprobs=[[0.0]] * 7)
    parts = mini_batches(batch, 3, seed=0)
    assert sorted(t[0] for p in parts for t in p.token_ids) == list(range(7))
    assert [len(p) for p in parts] == [3, 2, 2]
    assert all(p.advantages == [[float(t[0])] for t in p.token_ids] for p in parts)
    assert mini_batches(batch, 3, seed=0)[0].token_ids == parts[0].token_ids  # deterministic per seed


def test_task_stream_resumes_in_the_same_order() -> None:
    tasks = [Task("echo", f"t{i}", []) for i in range(5)]
    reference = TaskStream(tasks, seed=4)
    order = [t.task_id for t in reference.next(12)]  # crosses two epoch boundaries
    assert sorted(order[:5]) == [f"t{i}" for i in range(5)] and order[:5] != order[5:10]
    first = TaskStream(tasks, seed=4)
    head = [t.task_id for t in first.next(7)]
    resumed = TaskStream(tasks, seed=4)
    resumed.restore(first.state())
    assert head + [t.task_id for t in resumed.next(5)] == order
    with pytest.raises(ValueError, match="taken with 5 training tasks, the config gives 4"):
        TaskStream(tasks[:4], seed=4).restore(first.state())
    with pytest.raises(ValueError, match="has no tasks"):
        TaskStream([], seed=0)


def test_staleness_per_turn_and_its_bound() -> None:
    # Trainer at version 5; turns generated with versions 5, 4 | 4 | 3, 5 (a group of two).
    groups = [
        EpisodeGroup("a", TASK, [episode("a", [1.0, 0.0], versions=[5, 4]), episode("a", [0.0], versions=[4])]),
        EpisodeGroup("b", TASK, [episode("b", [1.0, 1.0], versions=[3, 5]), episode("b", [0.0], versions=[5])]),
    ]
    kept, metrics = bound_staleness(groups, 5, None)
    assert kept == groups
    assert metrics == {"rollout/staleness_mean": (0 + 1 + 1 + 2 + 0 + 0) / 6, "rollout/staleness_max": 2.0}
    kept, metrics = bound_staleness(groups, 5, 1)  # group b holds a turn two versions old: dropped whole
    assert [g.group_id for g in kept] == ["a"]
    assert metrics == {"batch/stale_groups": 1.0, "rollout/staleness_mean": 2 / 3, "rollout/staleness_max": 1.0}
    assert bound_staleness(groups, 5, 2)[1]["batch/stale_groups"] == 0.0
    assert bound_staleness([], 5, 1) == ([], {"batch/stale_groups": 0.0})

    prepared = prepare_batch(groups, AlgoConfig())
    assert prepared is not None
    assert prepared.batch.turn_versions == [[5, 4], [4], [3, 5], [5]]  # the batch says which weights made each turn
    minis = mini_batches(prepared.batch, 2, seed=0)
    assert [b.turn_versions for b in minis] == [[[4], [3, 5]], [[5, 4], [5]]]  # the rows move with their episodes
    assert [[len(v) for v in b.turn_versions] for b in minis] == [
        [(len(t) - 2) // 3 for t in b.token_ids] for b in minis
    ]
