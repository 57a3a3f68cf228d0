"""Running an evaluation: one job per (task, sample), a bounded number in flight, each finished episode cached,
episodes lost to the infrastructure retried and then reported apart, a progress line with ETA and running means.

`plan_jobs` gives every job its cache key and sampling; `run_jobs` plays the jobs the cache does not hold yet and
returns every job's record in job order, cached or new. The records are `observability.dumps.episode_record`s
with the sample index, the cache key, the attempts made, the full message transcript and an `infra_failed` flag.
"""

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from userrl_megatron.eval.cache import EpisodeCache, cache_key
from userrl_megatron.eval.policy import Policy
from userrl_megatron.observability.dumps import episode_record
from userrl_megatron.observability.progress import format_duration
from userrl_megatron.rollout.summary import is_infra_failure
from userrl_megatron.types import Episode, SamplingParams, Task

log = logging.getLogger("userrl_megatron.progress")

PROGRESS_EVERY_S = 10.0  # seconds between progress lines while episodes finish


@dataclass
class EvalJob:
    """One episode to play: a task, its sample index, its sampling and its cache key."""

    task: Task
    sample: int
    sampling: SamplingParams
    key: str


def task_digest(task: Task) -> str:
    """A hash of what the policy and the gym see of a task (id, prompt, tools, metadata)."""
    return cache_key(
        {
            "gym": task.gym,
            "task_id": task.task_id,
            "prompt": [m.to_dict() for m in task.prompt],
            "tools": task.tools,
            "metadata": task.metadata,
        }
    )


def sample_seed(seed: int, task_id: str, sample: int) -> int:
    """A per-episode sampling seed: the same episode draws the same tokens in a resumed run."""
    return int(hashlib.sha256(f"{seed}:{task_id}:{sample}".encode()).hexdigest()[:8], 16)


def plan_jobs(
    tasks: list[Task],
    samples: int,
    sampling: SamplingParams,
    seed: int,
    context: dict[str, Any],
    gym_context: Callable[[str], dict[str, Any]],
) -> list[EvalJob]:
    """`samples` jobs per task, in task order. Each key hashes `context` (policy, protocol), `gym_context(gym)`
    (the gym's settings and simulator), the task digest, the sampling (with its per-episode seed) and the sample."""
    jobs = []
    per_gym: dict[str, dict[str, Any]] = {}
    for task in tasks:
        if task.gym not in per_gym:
            per_gym[task.gym] = gym_context(task.gym)
        digest = task_digest(task)
        for sample in range(samples):
            job_sampling = sampling
            if sampling.temperature > 0:
                job_sampling = dataclasses.replace(sampling, seed=sample_seed(seed, task.task_id, sample))
            parts = {
                "context": context,
                "gym": per_gym[task.gym],
                "task": digest,
                "sampling": job_sampling.to_dict(),
                "sample": sample,
            }
            jobs.append(EvalJob(task, sample, job_sampling, cache_key(parts)))
    return jobs


def eval_record(job: EvalJob, episode: Episode, attempts: int) -> dict[str, Any]:
    """The episodes.jsonl record of a job's episode."""
    record = episode_record(episode)
    record.update(
        sample=job.sample,
        key=job.key,
        attempts=attempts,
        infra_failed=is_infra_failure(episode),
        messages=episode.metadata.get("messages", []),
    )
    return record


class EvalProgress:
    """`eval: 12/40 episodes (8 cached), 1m02s, ETA 3m10s | function 0.417 (n=6) | ...`: counts, elapsed time, an
    ETA from this process's episode rate, and each gym's running mean return (infrastructure failures apart)."""

    def __init__(self, total: int, cached: list[dict[str, Any]], clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.cached = len(cached)
        self.clock = clock
        self.started = clock()
        self.new = 0
        self.sums: dict[str, list[float]] = {}
        self.infra = 0
        for record in cached:
            self._count(record)

    def _count(self, record: dict[str, Any]) -> None:
        if record.get("infra_failed"):
            self.infra += 1
            return
        total = self.sums.setdefault(record["gym"], [0.0, 0])
        total[0] += record["reward"]
        total[1] += 1

    def add(self, record: dict[str, Any]) -> None:
        """Count an episode this process finished."""
        self.new += 1
        self._count(record)

    def line(self) -> str:
        done = self.cached + self.new
        elapsed = self.clock() - self.started
        left = self.total - done
        if left == 0:
            eta = "done"
        elif self.new:
            eta = f"ETA {format_duration(elapsed / self.new * left)}"
        else:
            eta = "ETA ?"
        parts = [f"eval: {done}/{self.total} episodes ({self.cached} cached), {format_duration(elapsed)}, {eta}"]
        parts += [f"{gym} {s / n:.3f} (n={n})" for gym, (s, n) in self.sums.items()]
        if self.infra:
            parts.append(f"infra failures {self.infra}")
        return " | ".join(parts)


async def run_jobs(
    jobs: list[EvalJob],
    policy: Policy,
    cache: EpisodeCache,
    concurrency: int,
    retries: int,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> list[dict[str, Any]]:
    """Play every job the cache lacks (at most `concurrency` at once); returns all records in job order.

    An episode ended by the infrastructure (engine or simulator failure) is played again up to `retries` times;
    if it still fails its record says `infra_failed` and it is not cached. Episodes are cached as they finish."""
    if concurrency < 1 or retries < 0:
        raise ValueError(f"concurrency must be >= 1 and retries >= 0, got {concurrency} and {retries}")
    cached = [r for job in jobs if (r := cache.get(job.key)) is not None]
    progress = EvalProgress(len(jobs), cached)
    gate = asyncio.Semaphore(concurrency)
    last = [time.monotonic()]

    async def play(job: EvalJob) -> dict[str, Any]:
        hit = cache.get(job.key)
        if hit is not None:
            return hit
        async with gate:
            for attempt in range(1, retries + 2):
                episode_id = f"{job.key[:12]}-{attempt}"
                episode = await policy.run(job.task, episode_id, job.sampling)
                if not is_infra_failure(episode):
                    break
                log.warning(
                    "eval: %s/%s sample %d lost to the infrastructure (%s: %s), attempt %d of %d",
                    job.task.gym, job.task.task_id, job.sample, episode.finish_reason,
                    episode.metadata.get("error", ""), attempt, retries + 1,
                )  # fmt: skip
        record = eval_record(job, episode, attempt)
        if not record["infra_failed"]:
            cache.put(job.key, record)
        progress.add(record)
        if time.monotonic() - last[0] >= progress_every_s:
            last[0] = time.monotonic()
            log.info(progress.line())
        return record

    log.info(progress.line())
    records = await asyncio.gather(*(play(job) for job in jobs))
    if progress.new:  # all cached: the first line already said "done"
        log.info(progress.line())
    return list(records)
