"""The user simulator's engines (`fleet/simulator.py`) on Ray: a real embedded engine started by the project's pool,
the gyms' real simulator client over its OpenAI route, and the engine killed between calls."""

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.support.chatty import make_chatty_model
from userrl_megatron.config import load_config
from userrl_megatron.fleet.simulator import managed_client, simulator_pool, simulator_rollout

pytestmark = pytest.mark.distributed

MESSAGES = [{"role": "system", "content": "You are the user."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatty_model(tmp_path_factory.mktemp("chatty") / "model")


def test_the_client_follows_a_killed_and_restarted_engine(ray_cluster: object, chatty: Path, tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            f"user_sim.engines.model={chatty}",
            "user_sim.max_tokens=8",
            # One retry after a backoff of at most 0.3 s, which no restart fits in: a call that found the engine down
            # is answered only because its retry waits for the pool's restart (`reconnect`), however long it takes.
            "user_sim.max_retries=1",
            "user_sim.backoff_s=0.2",
            "rollout.health_check_interval_s=0.5",
            "rollout.embedded.base_port=0",
        ],
        check=False,
    )

    async def run() -> dict[str, Any]:
        async with simulator_pool(cfg, tmp_path) as pool:
            sim = managed_client(cfg, pool)
            before = await sim.chat(MESSAGES)
            first_url = pool.urls[0]
            await pool.kill_engine_server(0)
            after = await asyncio.gather(*(sim.chat(MESSAGES) for _ in range(4)))
            state = {
                "replies": [r.text for r in (before, *after)],
                "urls": (first_url, pool.urls[0]),
                "restarts": pool.restarts_total,
                "metrics": sim.metrics(),
                "client_url": sim.cfg.base_url,
                "model": sim.cfg.model,
                "key": pool.api_key,
            }
            await sim.close()
            return state

    state = asyncio.run(run())
    assert len(state["replies"]) == 5 and all(isinstance(t, str) for t in state["replies"])
    first, second = state["urls"]
    assert first != second and state["restarts"] == 1  # restarted at a new address...
    assert state["client_url"] == f"{second}/v1"  # ...which the client follows
    assert (state["metrics"]["answered"], state["metrics"]["failures"]) == (5.0, 0.0)  # no call lost
    assert state["metrics"]["retries/connection"] == 4.0  # each call after the kill: once, after the restart
    assert state["model"] == str(chatty) and len(state["key"]) > 20  # the served name; a key made for the run


def test_the_simulator_engines_settings() -> None:
    cfg = load_config(
        overrides=["user_sim.engines.model=m", "user_sim.engines.num_engines=2", "user_sim.engines.engine_tp=4"],
        check=False,
    )
    rollout = simulator_rollout(cfg)
    assert (rollout.num_engines, rollout.engine_tp, rollout.colocate, rollout.router) == (2, 4, False, "sglang")
    assert rollout.backend == cfg.rollout.backend and rollout.api_key_env == "USERRL_USER_SIM_ENGINE_KEY"
    one = simulator_rollout(load_config(overrides=["user_sim.engines.model=m", "rollout.colocate=true"], check=False))
    assert (one.router, one.colocate) == ("none", False)  # never in the policy's memory hand-offs
