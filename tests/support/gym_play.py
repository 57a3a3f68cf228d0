"""Driving a gym from sync tests: play a list of actions and collect the step results."""

import asyncio
from typing import Any

from gyms.base import StepResult, make_gym


def play(gym: Any, actions: list[str]) -> list[StepResult]:
    """Reset `gym`, apply `actions` in order, close it; returns every step result."""

    async def run() -> list[StepResult]:
        await gym.reset()
        try:
            return [await gym.step(a) for a in actions]
        finally:
            await gym.close()

    return asyncio.run(run())


def play_new(name: str, task: Any, actions: list[str], config: Any = None, user_sim: Any = None) -> list[StepResult]:
    """make_gym + play."""
    return play(make_gym(name, task, config=config, user_sim=user_sim), actions)
