"""Scripted smoke episodes: each gym module lists a few, `userrl gym smoke` runs them all and prints a table.

An episode is a fixed list of actions with the reward expected after each, on an inline task record (no data
needed). Gyms that call the user simulator get a ScriptedUserSim, which answers from the episode's script
instead of an LLM (pass `live=True` to `run_smoke` to use the configured simulator: rewards then depend on
the LLM, so only "no crash" is checked).
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyms.user_sim import Reply, UserSimError

Script = Callable[[list[dict[str, Any]]], str]


@dataclass
class SmokeEpisode:
    title: str  # what the episode exercises
    task: Any  # a task record (or task id) for make_gym
    actions: list[str]  # the agent's actions, in order
    rewards: list[float]  # expected reward after each action
    end: str = "done"  # expected end after the last action: "done", "truncated" or "open"
    script: Script | None = None  # the simulator's replies (gyms that need one)
    config: Any = None  # gym config (default: the gym's defaults)


def by_prompt(replies: dict[str, list[str]]) -> Script:
    """A script answering each call with the next reply listed under the first key found in its system prompt."""
    queues = {key: list(values) for key, values in replies.items()}

    def answer(messages: list[dict[str, Any]]) -> str:
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        for key, queue in queues.items():
            if key in system:
                if not queue:
                    raise UserSimError(f"script exhausted for prompts containing {key!r}", "script", 1)
                return queue.pop(0)
        raise UserSimError(f"no scripted reply for system prompt {system[:80]!r}", "script", 1)

    return answer


class ScriptedUserSim:
    """Answers `chat` calls from a script instead of an LLM (same interface as UserSimulator)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls = 0

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        temperature: Any = None,
        max_tokens: Any = None,
        json: bool = False,
        schema: Any = None,
    ) -> Reply:
        from gyms.reply_json import extract_json_object

        self.calls += 1
        text = self.script(messages)
        data = extract_json_object(text) if json else None
        if json and data is None:
            raise UserSimError(f"scripted reply has no JSON object: {text[:80]!r}", "bad_json", 1)
        return Reply(text=text, data=data)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        return {"calls": float(self.calls)}


@dataclass
class SmokeResult:
    gym: str
    title: str
    steps: int
    total_reward: float
    end: str
    ok: bool
    problem: str = ""
    seconds: float = 0.0
    rewards: list[float] = field(default_factory=list)


async def run_episode(gym_name: str, episode: SmokeEpisode, user_sim: Any = None) -> SmokeResult:
    """Play one smoke episode; compare rewards and the end with the expectations unless `user_sim` is live."""
    from gyms.base import make_gym

    live = user_sim is not None
    sim = user_sim if live else ScriptedUserSim(episode.script or by_prompt({}))
    start = time.perf_counter()
    gym = make_gym(gym_name, episode.task, config=episode.config, user_sim=sim)
    rewards, end, problem = [], "open", ""
    try:
        actions = episode.actions
        try:
            await gym.reset()
        except UserSimError as e:  # a gym whose first message comes from the simulator (first_message_at_reset)
            actions, problem = [], f"user simulator error at reset: {e}"
        for action in actions:
            result = await gym.step(action)
            rewards.append(result.reward)
            if result.user_sim_error is not None:
                problem = f"user simulator error: {result.user_sim_error}"
            if result.ended:
                end = "done" if result.done else "truncated"
                break
    finally:
        await gym.close()
    if not live and not problem:
        if rewards != episode.rewards:
            problem = f"rewards {rewards} != expected {episode.rewards}"
        elif end != episode.end:
            problem = f"ended {end!r}, expected {episode.end!r}"
    return SmokeResult(
        gym_name,
        episode.title,
        len(rewards),
        round(sum(rewards), 6),
        end,
        not problem,
        problem,
        time.perf_counter() - start,
        rewards,
    )


def run_smoke(names: list[str], user_sim: Any = None) -> list[SmokeResult]:
    """Run every smoke episode of the named gyms (all episodes concurrently)."""
    from gyms.base import gym_spec

    jobs = [(name, ep) for name in names for ep in (gym_spec(name).smoke or (lambda: []))()]

    async def main() -> list[SmokeResult]:
        return await asyncio.gather(*(run_episode(name, ep, user_sim) for name, ep in jobs))

    return asyncio.run(main())
