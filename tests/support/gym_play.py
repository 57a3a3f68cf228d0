"""Driving gyms from sync tests: play a list of actions, with the real UserSimulator against a test server."""

import asyncio
from typing import Any

from gyms.base import StepResult, make_gym
from gyms.user_sim import UserSimulator
from tests.support.openai_server import OpenAIServer
from userrl_megatron.config.schema import UserSimConfig

SIM_TIMEOUT_S = 60.0  # only a hang reaches it: a valid reply on a busy machine is never cut off and retried


def sim_for(server: OpenAIServer, **overrides: Any) -> UserSimulator:
    """A UserSimulator on `server` with tiny backoffs (tests never sleep for long)."""
    cfg = UserSimConfig(base_url=server.base_url, model="sim", timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=2)
    cfg.api_key_env = "none"  # our local server needs no key
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return UserSimulator(cfg)


def play(gym: Any, actions: list[str]) -> list[StepResult]:
    """Reset `gym`, apply `actions` in order, close it (and its simulator's client); returns every step result."""

    async def run() -> list[StepResult]:
        await gym.reset()
        try:
            return [await gym.step(a) for a in actions]
        finally:
            await gym.close()
            if isinstance(gym.user_sim, UserSimulator):
                await gym.user_sim.close()

    return asyncio.run(run())


def play_new(name: str, task: Any, actions: list[str], config: Any = None, user_sim: Any = None) -> list[StepResult]:
    """make_gym + play."""
    return play(make_gym(name, task, config=config, user_sim=user_sim), actions)
