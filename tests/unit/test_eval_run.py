"""Running an evaluation: resume after an interruption (no episode lost or played twice), a changed setting never
reuses the cache, infrastructure failures retried then reported apart, a torn cache line ignored.

The policy here plays the real FunctionGym (answering right on even task indices); what is under test is the
scheduling and the cache, not a model."""

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gyms import config_for, make_gym
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.eval.cache import EpisodeCache
from userrl_megatron.eval.run import EvalJob, EvalProgress, plan_jobs, run_jobs
from userrl_megatron.types import Episode, SamplingParams, Task, Turn

GYMS = GymsConfig()
SAMPLING = SamplingParams(max_new_tokens=32, temperature=0.0)


class Interrupted(BaseException):
    """Stands for Ctrl-C / a kill arriving while episodes run."""


class GymPlayer:
    """A policy that answers each FunctionGym task once: right on even task indices, wrong on odd ones."""

    identity: ClassVar[dict[str, str]] = {"kind": "test"}
    concurrency = 4

    def __init__(self, stop_after: int | None = None, fail: dict[str, int] | None = None) -> None:
        self.played: list[tuple[str, str]] = []  # (task id, episode id) of each episode started
        self.stop_after = stop_after
        self.fail = dict(fail or {})  # task id -> episodes of it that end with an engine error first

    async def run(self, task: Task, episode_id: str, sampling: SamplingParams) -> Episode:
        if self.stop_after is not None and len(self.played) >= self.stop_after:
            raise Interrupted
        self.played.append((task.task_id, episode_id))
        episode = Episode(task=task, group_id=task.task_id)
        if self.fail.get(task.task_id, 0) > 0:
            self.fail[task.task_id] -= 1
            episode.finish_reason = "engine_error"
            episode.metadata["error"] = "EngineError: connection refused"
            return episode
        gym = make_gym(task.gym, task, config_for(task.gym, GYMS, 4))
        await gym.reset()
        expected = task.metadata["record"]["expected_result"]
        index = int(task.task_id.rsplit("-", 1)[1])
        answer = expected if index % 2 == 0 else expected + 1
        result = await gym.step(f"[answer] {answer}")
        episode.turns.append(Turn(0, 0, 0, f"[answer] {answer}", f"[answer] {answer}", result.feedback, result.reward))
        episode.finish_reason = "done" if result.done else "max_turns"
        await gym.close()
        return episode


def tasks(n: int = 4) -> list[Task]:
    return load_tasks(["function-procedural"], "test", GYMS)[:n]


def jobs(
    sampling: SamplingParams = SAMPLING, samples: int = 2, settings: dict[str, Any] | None = None
) -> list[EvalJob]:
    gym = settings or dataclasses.asdict(config_for("function", GYMS, 4))
    return plan_jobs(tasks(), samples, sampling, 0, {"policy": GymPlayer.identity}, lambda _: {"settings": gym})


def run(job_list: list[EvalJob], player: GymPlayer, cache: EpisodeCache, retries: int = 2) -> list[dict[str, Any]]:
    return asyncio.run(run_jobs(job_list, player, cache, concurrency=1, retries=retries))


def essence(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["task_id"], r["sample"], r["turn_rewards"], r["finish_reason"], r["key"]) for r in records]


def test_an_interrupted_run_resumes_without_losing_or_repeating_an_episode(tmp_path: Path) -> None:
    fresh = run(jobs(), GymPlayer(), EpisodeCache(tmp_path / "fresh.jsonl"))
    assert [r["turn_rewards"] for r in fresh] == [[1.0], [1.0], [0.0], [0.0]] * 2

    path = tmp_path / "cache.jsonl"
    with pytest.raises(Interrupted):
        run(jobs(), GymPlayer(stop_after=3), EpisodeCache(path))
    assert len(path.read_text().splitlines()) == 3  # the three finished episodes were kept

    resumed = GymPlayer()
    records = run(jobs(), resumed, EpisodeCache(path))
    assert len(resumed.played) == 5  # only the missing ones
    played_keys = {r["key"] for r in records if r["attempts"] == 1} - {
        json.loads(line)["key"] for line in path.read_text().splitlines()[:3]
    }
    assert len(played_keys) == 5
    assert essence(records) == essence(fresh)
    assert len(path.read_text().splitlines()) == 8  # each episode cached once


def test_a_changed_temperature_or_gym_setting_runs_every_episode_again(tmp_path: Path) -> None:
    cache = EpisodeCache(tmp_path / "cache.jsonl")
    run(jobs(), GymPlayer(), cache)
    again = GymPlayer()
    run(jobs(), again, cache)
    assert again.played == []
    warmer = GymPlayer()
    run(jobs(dataclasses.replace(SAMPLING, temperature=0.7)), warmer, cache)
    assert len(warmer.played) == 8
    other_gym = GymPlayer()
    run(jobs(settings={"max_steps": 5}), other_gym, cache)
    assert len(other_gym.played) == 8
    assert len({j.key for j in jobs()} | {j.key for j in jobs(dataclasses.replace(SAMPLING, temperature=0.7))}) == 16


def test_sampled_episodes_get_distinct_reproducible_seeds() -> None:
    hot = jobs(dataclasses.replace(SAMPLING, temperature=1.0))
    seeds = [j.sampling.seed for j in hot]
    assert None not in seeds and len(set(seeds)) == 8
    assert seeds == [j.sampling.seed for j in jobs(dataclasses.replace(SAMPLING, temperature=1.0))]
    assert {j.sampling.seed for j in jobs()} == {None}  # greedy episodes need none


def test_infrastructure_failures_are_retried_then_reported_and_not_cached(tmp_path: Path) -> None:
    ids = [t.task_id for t in tasks()]
    # task 0: fails once then succeeds; task 1: fails on every attempt (2 samples x 3 attempts)
    player = GymPlayer(fail={ids[0]: 1, ids[1]: 6})
    cache = EpisodeCache(tmp_path / "cache.jsonl")
    records = run(jobs(), player, cache, retries=2)
    by_task = {(r["task_id"], r["sample"]): r for r in records}
    first = [by_task[(ids[0], 0)], by_task[(ids[0], 1)]]
    assert sorted(r["attempts"] for r in first) == [1, 2] and not any(r["infra_failed"] for r in first)
    lost = [by_task[(ids[1], 0)], by_task[(ids[1], 1)]]
    assert all(r["infra_failed"] and r["attempts"] == 3 and r["finish_reason"] == "engine_error" for r in lost)
    assert len(cache) == 6  # the lost ones are not cached...
    retry = GymPlayer()
    run(jobs(), retry, EpisodeCache(tmp_path / "cache.jsonl"))
    assert sorted(t for t, _ in retry.played) == [ids[1], ids[1]]  # ...so a resumed run tries them again


def test_a_torn_last_cache_line_is_ignored_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "cache.jsonl"
    cache = EpisodeCache(path)
    cache.put("a", {"reward": 1.0})
    cache.put("b", {"reward": 0.0})
    with path.open("a") as f:
        f.write('{"key": "c", "record": {"rew')  # killed mid-write
    reloaded = EpisodeCache(path)
    assert len(reloaded) == 2 and reloaded.get("a") == {"reward": 1.0}
    reloaded.put("c", {"reward": 0.5})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_progress_line_counts_cached_episodes_and_running_means() -> None:
    clock = iter([0.0, 30.0]).__next__
    progress = EvalProgress(10, [{"gym": "function", "reward": 1.0}, {"gym": "travel", "reward": 0.4}], clock)
    progress.add({"gym": "function", "reward": 0.0})
    progress.add({"gym": "function", "reward": 0.0, "infra_failed": True})
    assert progress.line() == (
        "eval: 4/10 episodes (2 cached), 30s, ETA 1m30s | function 0.500 (n=2) | travel 0.400 (n=1) | infra failures 1"
    )


def test_a_finished_evaluation_prints_one_progress_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = EpisodeCache(tmp_path / "c.jsonl")
    with caplog.at_level(logging.INFO, logger="userrl_megatron.progress"):
        run(jobs(), GymPlayer(), cache)
        played = [r.getMessage() for r in caplog.records]
        caplog.clear()
        run(jobs(), GymPlayer(), cache)
    assert played[0].startswith("eval: 0/8 episodes (0 cached)") and played[-1].startswith("eval: 8/8 episodes")
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("eval: 8/8 episodes (8 cached), ") and line.endswith(", done | function 0.500 (n=8)")


def test_bad_concurrency_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1 and retries >= 0, got 0 and 2"):
        asyncio.run(run_jobs(jobs(), GymPlayer(), EpisodeCache(tmp_path / "c.jsonl"), 0, 2))
