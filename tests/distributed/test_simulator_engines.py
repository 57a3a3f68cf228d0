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
    assert state["model"] == chatty.name and len(state["key"]) > 20  # the served name (no path); a run-made key


@pytest.mark.slow
def test_a_real_sglang_server_serves_the_simulator(ray_cluster: object, tmp_path: Path) -> None:
    """`user_sim.engines.backend: sglang` (the cluster recipes' backend) through the real SGLang 0.5.23 server on CPU:
    the pool launches it with the run's key, the gyms' client is answered on its OpenAI route, and a request
    without the key is refused."""
    import httpx

    from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON

    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    cfg = load_config(
        overrides=[
            "user_sim.engines.model=smollm2-135m-instruct",
            "user_sim.engines.backend=sglang",
            "user_sim.engines.dtype=float32",  # SGLang would otherwise serve the fp32 checkpoint in fp16
            "user_sim.max_tokens=8",
            "rollout.sglang.device=cpu",
            "rollout.sglang.base_port=0",
            "rollout.sglang.max_total_tokens=4096",
            "rollout.sglang.startup_timeout_s=1200",  # a hung server only: start-up is 30-110 s on 2 cores
            "rollout.health_check_interval_s=0",
        ],
        check=False,
    )

    async def run() -> dict[str, Any]:
        async with simulator_pool(cfg, tmp_path) as pool:
            sim = managed_client(cfg, pool)
            replies = await asyncio.gather(*(sim.chat(MESSAGES) for _ in range(3)))
            async with httpx.AsyncClient(timeout=60) as http:
                anonymous = await http.post(
                    f"{pool.urls[0]}/v1/chat/completions",
                    json={"model": sim.cfg.model, "messages": MESSAGES, "max_tokens": 2},
                )
            state = {"replies": [r.text for r in replies], "metrics": sim.metrics(), "anonymous": anonymous.status_code}
            await sim.close()
            return state

    state = asyncio.run(run())
    assert len(state["replies"]) == 3 and all(isinstance(t, str) and t for t in state["replies"])
    assert (state["metrics"]["answered"], state["metrics"]["failures"]) == (3.0, 0.0)
    assert state["anonymous"] == 401  # the run's key, handed over in memory, is the only way in


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
    shared = ["user_sim.engines.model=m", "user_sim.engines.placement=policy_engines"]
    beside = simulator_rollout(load_config(overrides=[*shared, "rollout.colocate=true"], check=False))
    assert beside.colocate and not beside.sglang.enable_weights_cpu_backup  # memory saver on; weights never released
    assert not simulator_rollout(load_config(overrides=shared, check=False)).colocate  # nothing steps aside


def test_the_simulator_engines_memory_and_context() -> None:
    """0 takes the policy engines' memory fraction and the simulator model's own context length (never the policy
    engines'); set, both reach SGLang's and the embedded server's settings. What only the policy's engines need
    (a weight backup for memory releases, routed experts for routing replay) is off."""
    policy = [
        "user_sim.engines.model=m",
        "rollout.sglang.mem_fraction_static=0.6",
        "rollout.sglang.context_length=4096",
        "rollout.sglang.enable_weights_cpu_backup=true",
        "rollout.sglang.enable_return_routed_experts=true",
        "rollout.embedded.context_length=4096",
        "rollout.embedded.enable_return_routed_experts=true",
    ]
    default = simulator_rollout(load_config(overrides=policy, check=False))
    assert default.sglang.mem_fraction_static == 0.6
    assert default.sglang.context_length == default.embedded.context_length == 0
    assert not default.sglang.enable_weights_cpu_backup and not default.sglang.enable_return_routed_experts
    assert not default.embedded.enable_return_routed_experts
    own = ["user_sim.engines.mem_fraction_static=0.85", "user_sim.engines.context_length=32768"]
    rollout = simulator_rollout(load_config(overrides=policy + own, check=False))
    assert (rollout.sglang.mem_fraction_static, rollout.sglang.context_length) == (0.85, 32768)
    assert rollout.embedded.context_length == 32768
