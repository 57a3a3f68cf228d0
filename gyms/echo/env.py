"""EchoGym: each turn the user names a letter and the agent should reply with it; the episode lasts `turns` turns.

A turn's reward is the share of the reply's characters that are the requested letter (1.0 for "b" or "bbb"
when "b" was asked, 0.5 for "ba", 0 for an empty reply), so even a tiny random policy gets a graded signal
and can learn within a few RL steps. No LLM, no data: tasks come from the `echo-procedural` source.
Plain-text replies reach the gym as `[action] <text>` (Task.metadata["reply_without_tool_call"] = "action").

With `reply_delay_median_s` the user takes a log-normal time to answer each step (median and 99th percentile
from the config): the heavy tail of a simulated user behind an API, for benchmarks of asynchronous rollouts.
"""

import asyncio
import itertools
import math
import random
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.echo.settings import EchoGymConfig
from gyms.smoke import SmokeEpisode
from gyms.turn_gym import TurnGym
from userrl_megatron.types import Message, Task

PROCEDURAL_SOURCE = "echo-procedural"
Z99 = 2.3263478740408408  # the standard normal's 99th percentile
_episodes = itertools.count()  # numbers the gyms of a process: each episode draws its own seeded delays
SYSTEM_PROMPT = "Reply with the letter the user asks for, and nothing else."


class EchoGym(TurnGym):
    name = "echo"

    def __init__(self, task: Any, config: EchoGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or EchoGymConfig()
        super().__init__(self.config.max_steps)
        self.record = task_record(task, lambda task_id: echo_record(task_id, self.config))
        self.targets: list[str] = list(self.record["targets"])
        self.delays = random.Random(f"{self.config.seed}-{self.record['id']}-{next(_episodes)}")

    def observation(self) -> str:
        return _request(self.targets[0])

    async def act(self, tag: str | None, payload: str) -> StepResult:
        delay = reply_delay(self.delays, self.config.reply_delay_median_s, self.config.reply_delay_p99_s)
        if delay > 0:
            await asyncio.sleep(delay)
        if tag == "finish":
            return StepResult("Bye.", 0.0, done=True)
        target = self.targets[min(self.steps, len(self.targets)) - 1]
        reply = payload.strip()
        reward = round(reply.count(target) / len(reply), 4) if reply else 0.0
        if self.steps >= len(self.targets):
            return StepResult("Thanks, that is all.", reward, done=True)
        return StepResult(_request(self.targets[self.steps]), reward)


def reply_delay(rng: random.Random, median_s: float, p99_s: float) -> float:
    """A log-normal delay with the given median and 99th percentile (0 when the median is 0)."""
    if median_s <= 0:
        return 0.0
    sigma = math.log(max(p99_s, median_s) / median_s) / Z99
    return rng.lognormvariate(math.log(median_s), sigma)


def _request(letter: str) -> str:
    return f"Say {letter}."


def echo_record(task_id: str, config: EchoGymConfig) -> dict[str, Any]:
    """The record of `echo-<split>-<index>`: its per-turn target letters, drawn from the seeded stream."""
    try:
        _, split, index = task_id.split("-")
        rng = random.Random(f"{config.seed}-{split}-{int(index)}")
    except ValueError:
        raise KeyError(f"EchoGym has no task {task_id!r} (ids look like echo-train-12)") from None
    if config.same_letter:
        return {"id": task_id, "targets": [rng.choice(config.alphabet)] * config.turns}
    return {"id": task_id, "targets": [rng.choice(config.alphabet) for _ in range(config.turns)]}


def echo_tasks(split: str, config: EchoGymConfig) -> list[Task]:
    """`config.tasks_per_split` tasks of `split`."""
    return [echo_task(echo_record(f"echo-{split}-{i}", config)) for i in range(config.tasks_per_split)]


def echo_task(record: dict[str, Any]) -> Task:
    return Task(
        gym="echo",
        task_id=record["id"],
        prompt=[Message("system", SYSTEM_PROMPT), Message("user", _request(record["targets"][0]))],
        tools=[],
        metadata={"record": record, "reply_without_tool_call": "action", "data_source": PROCEDURAL_SOURCE},
    )


def echo_smoke() -> list[SmokeEpisode]:
    """A perfect episode and a wrong one."""
    record = {"id": "echo-smoke-0", "targets": ["a", "b"]}
    return [
        SmokeEpisode("perfect replies", record, ["[action] a", "[action] bb"], [1.0, 1.0]),
        SmokeEpisode("partly right, then wrong", record, ["[action] ab", "[action] xyz"], [0.5, 0.0]),
    ]


register_gym("echo", config_type=EchoGymConfig, smoke=echo_smoke, procedural={PROCEDURAL_SOURCE: echo_tasks})(EchoGym)
