"""The rollout pool on Ray with two real embedded engine servers (subprocesses), on placement-group bundles."""

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from gyms.base import Gym, StepResult
from tests.support.chatty import check_logprobs, function_task, make_chatty_model
from userrl_megatron.config.schema import EmbeddedServerConfig, GymsConfig, MegatronConfig, RolloutConfig
from userrl_megatron.fleet.placement import create_placement, plan_bundles
from userrl_megatron.fleet.pool import EngineSession, RolloutPool
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
from userrl_megatron.server import onednn
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.distributed

DEADLINE_S = 600.0  # waits for servers to (re)start and turns to be generated: only a hang reaches it


@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatty_model(tmp_path_factory.mktemp("chatty") / "model")


@pytest.fixture
def placement(ray_cluster: object) -> object:
    """Bundles for one actor rank and the two engines, released after the test."""
    from ray.util import remove_placement_group

    reserved = create_placement(plan_bundles(MegatronConfig(), pool_config(), use_gpu=False), timeout_s=DEADLINE_S)
    yield reserved
    remove_placement_group(reserved.group)


def pool_config(**overrides: object) -> RolloutConfig:
    return RolloutConfig(
        **{
            "num_engines": 2,
            "max_turns": 4,
            "max_new_tokens_per_turn": 24,
            "max_prompt_tokens": 400,
            "max_response_tokens": 300,
            "health_check_interval_s": 0.0,
            "embedded": EmbeddedServerConfig(base_port=0, max_running_requests=16),
            **overrides,
        }
    )


async def until(condition: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Poll `condition` until true, failing after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if await value if isinstance(value, Awaitable) else value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def server_info(url: str, key: str) -> dict:
    """An engine's `/server_info`, with the pool's key (every engine the pool starts requires it)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as http, http.get(url + "/server_info") as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def server_state(url: str, key: str) -> dict:
    return (await server_info(url, key))["internal_states"][0]


def test_routing_pause_and_health_checks(
    placement: object, chatty: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RolloutPool, "heartbeat_s", 0.2)  # the servers take seconds to start: a few beats
    caplog.set_level(logging.INFO, logger="userrl_megatron")
    # Two threads each (the cores shared would give one, as Ray's OMP_NUM_THREADS=1 would: not telling).
    embedded = EmbeddedServerConfig(base_port=0, max_running_requests=16, threads=2)
    cfg = pool_config(health_check_interval_s=0.5, embedded=embedded)
    chat = ChatTemplate.from_pretrained(chatty, "tags")
    prompt = chat.prompt_ids(function_task(0).prompt)
    turn = SamplingParams(max_new_tokens=8, stop_token_ids=chat.stop_token_ids)

    async def scenario() -> None:
        async with RolloutPool(cfg, str(chatty), placement=placement, log_dir=tmp_path) as pool:
            assert "rollout pool: 0/2 embedded engines up, " in caplog.text  # a heartbeat while they start
            assert len(pool.urls) == 2 and len(set(pool.urls)) == 2
            infos = [await server_info(url, pool.api_key) for url in pool.urls]
            linear = "onednn" if onednn.available() else "torch"  # rollout.embedded.cpu_linear, through the launcher
            assert [(i["cpu_threads"], i["cpu_linear"]) for i in infos] == [(2, linear), (2, linear)]
            assert pool.concurrency == 2 * cfg.max_concurrent_episodes
            a, b = pool.session("a"), pool.session("b")
            await asyncio.gather(a.generate(prompt, turn), b.generate(prompt, turn))
            assert (a.history, b.history) == ([0], [1])  # least outstanding: one each
            # Episode a keeps engine 0 even when a new episode's request is already there.
            c = pool.session("c")
            await asyncio.gather(c.generate(prompt, turn), a.generate(prompt, turn))
            assert (c.history, a.history) == ([0], [0, 0])

            # Pause while a long request (no stop token: it runs to max_new_tokens) is in flight on engine 1.
            long = SamplingParams(max_new_tokens=400, stop_token_ids=[])
            running = asyncio.create_task(b.generate(prompt, long))
            await until(lambda: _running(pool.urls[1], pool.api_key), "the long request to run")
            await pool.pause()
            state = await server_state(pool.urls[1], pool.api_key)
            assert (state["paused"], state["running"]) == (True, 0)  # aborted by the pause
            held = asyncio.create_task(pool.session("d").generate(prompt, turn))
            await asyncio.sleep(0)
            assert not running.done() and not held.done()
            await pool.resume()
            generation = await running
            # Generated again after resume, in full: no partial output of the aborted attempt.
            assert (generation.finish_reason, len(generation.output_ids)) == ("length", 400)
            assert (await held).finish_reason in ("stop", "length")
            await pool.flush_cache()
            assert await pool.check_health() == [True, True]
            assert [e.restarts for e in pool.engines] == [0, 0]

            # An engine that dies while idle is found by the periodic health check and restarted.
            killed = await pool.kill_engine_server(0)
            await until(lambda: pool.engines[0].restarts == 1 and pool.engines[0].healthy, "the restart")
            assert await pool.engines[0].actor.pid.remote() != killed
            assert await pool.check_health() == [True, True]

            # An engine whose Ray actor dies (as when Ray's memory monitor kills it) gets a new actor.
            gone = pool.engines[1].actor
            ray.kill(gone, no_restart=True)
            await until(lambda: pool.engines[1].restarts == 1 and pool.engines[1].healthy, "the new actor")
            assert pool.engines[1].actor is not gone and pool.restarts_total == 2
            assert await pool.check_health() == [True, True]
            assert (await pool.session("e").generate(prompt, turn)).finish_reason in ("stop", "length")

    asyncio.run(scenario())


async def _running(url: str, key: str) -> bool:
    return (await server_state(url, key))["running"] >= 1


def test_health_tells_slow_from_wedged_and_dead(placement: object, chatty: Path, tmp_path: Path) -> None:
    """Slow (alive, progress within the stall timeout) is left alone; wedged (answers, no progress, the
    generation probe does not pass) and dead (process gone) are restarted; with no engine left the pool is
    exhausted and fails at once."""
    from userrl_megatron.wire.generation import EngineError

    cfg = pool_config(engine_stall_timeout_s=600.0, engine_max_restarts=1)
    chat = ChatTemplate.from_pretrained(chatty, "tags")
    prompt = chat.prompt_ids(function_task(0).prompt)

    async def scenario() -> None:
        async with RolloutPool(cfg, str(chatty), placement=placement, log_dir=tmp_path) as pool:
            first = pool.engines[0]
            await first.client.pause()  # holds generation: its generation probe cannot pass now
            assert await pool.check_health() == [True, True]  # progress is recent: slow, not dead
            assert await pool.check_health(generating=False) == [True, True]
            pool.cfg.engine_stall_timeout_s = 1.0
            await until(lambda: time.monotonic() - first.progress_at > 1.0, "the stall timeout to pass")
            assert not await pool._probe(first)  # wedged: restarted (engine 1 is left out: not under test)
            await pool.wait_ready(DEADLINE_S)
            assert (first.restarts, first.healthy, first.epoch) == (1, True, 1)

            pool.cfg.engine_stall_timeout_s = 600.0
            session = pool.session("x")
            await session.generate(prompt, SamplingParams(4))
            assert first.restarts == 0  # it served again: the count of failed restarts starts afresh

            pool.cfg.engine_max_restarts = 0  # from now on a death is final
            for engine in pool.engines:
                os.kill(await engine.actor.pid.remote(), signal.SIGKILL)
                await until(lambda e=engine: _dead(pool, e.index), "the server process to die")
            assert await pool.check_health() == [False, False]
            await pool.wait_ready(DEADLINE_S)
            assert pool.exhausted
            with pytest.raises(EngineError, match="every engine"):
                await pool.session("y").generate(prompt, SamplingParams(4))
            with pytest.raises(EngineError, match="every engine"):
                await pool.repair(DEADLINE_S)

    asyncio.run(scenario())


class GatedGym:
    """A real gym whose first step waits for a gate: the test kills an engine while episodes are mid-way."""

    def __init__(self, inner: Gym, gate: asyncio.Event) -> None:
        self.inner, self.gate, self.name, self.steps = inner, gate, inner.name, 0

    async def reset(self) -> str:
        return await self.inner.reset()

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        if self.steps == 1:
            await self.gate.wait()
        return await self.inner.step(action)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture(params=["idle", "cpu_saturated"])
def machine_load(request: pytest.FixtureRequest) -> object:
    """The machine as it is, or with every core kept busy by other processes (a loaded CI or cluster node)."""
    burners = []
    if request.param == "cpu_saturated":
        burn = [sys.executable, "-c", "while True: pass"]
        burners = [subprocess.Popen(burn) for _ in range(os.cpu_count() or 2)]
    yield request.param
    for burner in burners:
        burner.kill()
        burner.wait()


def test_an_engine_killed_mid_rollout_loses_no_episode(
    placement: object, chatty: Path, tmp_path: Path, machine_load: str
) -> None:
    """Also under a saturated CPU, with health checks running: only the killed engine is restarted."""
    cfg = pool_config(health_check_interval_s=0.5)
    chat = ChatTemplate.from_pretrained(chatty, "tags")
    tasks = [function_task(i, reply_without_tool_call="action") for i in range(4)]
    make = gym_factory(GymsConfig(), cfg.max_turns)
    restarted: list[int] = []
    release = asyncio.Event()

    async def on_restart(index: int, client: object) -> None:
        """The restarted engine stays out of service until the rollout ends: its episodes must move."""
        restarted.append(index)
        await release.wait()

    async def scenario() -> tuple[list, dict[str, EngineSession], int, int]:
        gate = asyncio.Event()
        runner = EpisodeRunner(cfg, chat, lambda task: GatedGym(make(task), gate))
        pool = RolloutPool(cfg, str(chatty), placement=placement, log_dir=tmp_path)
        pool.add_restart_hook(on_restart)
        async with pool:
            sessions: dict[str, EngineSession] = {}

            def engine_for(episode_id: str) -> EngineSession:
                return sessions.setdefault(episode_id, pool.session(episode_id))

            rollout = asyncio.create_task(runner.run_groups(tasks, 4, engine_for, concurrency=16))
            # Every episode's first turn was generated: those still going wait at the gate.
            await until(lambda: sum(e.served for e in pool.engines) >= 16, "16 first turns")
            assert sorted(s.history[0] for s in sessions.values()) == [0] * 8 + [1] * 8
            killed = await pool.engines[1].actor.pid.remote()
            os.kill(killed, signal.SIGKILL)
            # The health checks find it dead and restart it at once: a poll of the process could miss the death.
            await until(lambda: pool.restarts_total == 1, "the pool to find the server dead")
            gate.set()
            groups = await rollout
            release.set()
            await pool.wait_ready(DEADLINE_S)
            pid = await pool.engines[1].actor.pid.remote()
            # The restarted engine serves again.
            probe = await pool.engines[1].client.generate(chat.prompt_ids(tasks[0].prompt), SamplingParams(4))
            assert len(probe.output_ids) == 4
            return groups, sessions, killed, pid

    groups, sessions, killed, pid = asyncio.run(scenario())
    episodes = [e for g in groups for e in g.episodes]
    assert len(episodes) == 16
    assert {e.finish_reason for e in episodes} <= {"max_turns", "truncated", "max_tokens", "done", "no_tool_call"}
    moved = [s.history for s in sessions.values() if s.history[0] == 1 and len(s.history) > 1]
    assert moved and all(h[1:] == [0] * (len(h) - 1) for h in moved)  # engine 1's episodes finished on engine 0
    assert restarted == [1] and pid not in (killed, -1)
    model = AutoModelForCausalLM.from_pretrained(chatty, dtype=torch.float32)
    for episode in episodes:
        episode.check()
        check_logprobs(episode, model)  # every engine served the same weights, token-exact


async def _dead(pool: RolloutPool, index: int) -> bool:
    return not await pool.engines[index].actor.alive.remote()


def test_rollout_command_on_the_pool(
    ray_cluster: object, chatty: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from userrl_megatron.cli import main
    from userrl_megatron.observability.dumps import read_episodes

    out = tmp_path / "rollouts.jsonl"
    args = [
        "rollout", "--limit", "3", "--samples", "2", "--out", str(out),
        f"model.path={chatty}", "model.tool_format=tags", "model.max_context_length=4096",
        "rollout.num_engines=2", "rollout.embedded.base_port=0", "rollout.max_prompt_tokens=2048",
        "rollout.max_response_tokens=256", "rollout.max_new_tokens_per_turn=32", "megatron.micro_batch_tokens=4096",
    ]  # fmt: skip
    assert main(args) == 0
    records = read_episodes(out)
    assert len(records) == 6
    assert [r["task_id"] for r in records] == [r["task_id"] for r in records[::2] for _ in range(2)]
    for record in records:
        assert record["gym"] == "function" and record["turns"]
        assert record["trained_tokens"] == sum(len(t["tokens"]) for t in record["turns"])
        assert all(t["generate_s"] > 0 for t in record["turns"])
    printed = capsys.readouterr().out
    assert "6 episodes in" in printed and "generated tokens/s" in printed
    assert any(line.startswith("│ function │        6 │") for line in printed.splitlines())


def test_a_turn_aborted_by_a_weight_push_is_generated_again_on_the_new_weights(
    placement: object, chatty: Path, tmp_path: Path
) -> None:
    """Partial rollouts at a turn boundary: the episode's second turn is in flight (queued on its paused engine)
    when the pool pauses for a push (SGLang's pause with abort); the new weight version lands, the pool resumes,
    and the turn is sent again from the same token ids. The episode keeps its first turn, stays token-exact
    (every generated token's log-prob is the model's own in the episode's context: nothing was re-tokenised),
    and each turn records the version that generated it."""
    cfg = pool_config(max_turns=3)
    chat = ChatTemplate.from_pretrained(chatty, "tags")
    task = function_task(0, reply_without_tool_call="action")
    make = gym_factory(GymsConfig(), cfg.max_turns)

    async def scenario() -> tuple:
        gate = asyncio.Event()
        gym = GatedGym(make(task), gate)
        runner = EpisodeRunner(cfg, chat, lambda _: gym)
        async with RolloutPool(cfg, str(chatty), placement=placement, log_dir=tmp_path) as pool:
            for client in pool.clients:
                await client.update_weight_version("4")
            session = pool.session("e")
            episode = asyncio.create_task(runner.run(task, session, "g", episode_id="e"))
            await until(lambda: gym.steps == 1, "the first turn")  # turn 1 generated; the gym holds at the gate
            engine = pool.engines[session.history[0]]
            await engine.client.pause()  # the engine alone: turn 2 is sent and queues there
            gate.set()
            await until(lambda: _waiting(engine.url, pool.api_key), "the second turn to queue on the paused engine")
            await pool.pause()  # the push: abort whatever is in flight, hold new requests
            state = await server_state(engine.url, pool.api_key)
            for client in pool.clients:
                await client.update_weight_version("5")
            await pool.resume()
            return await episode, state, len(session.history)

    episode, state, served = asyncio.run(scenario())
    assert (state["running"], state["waiting"]) == (0, 0)  # the queued turn was aborted by the pause
    assert len(episode.turns) >= 2 and served == len(episode.turns)  # the aborted attempt is not a turn
    assert [t.weight_version for t in episode.turns] == [4] + [5] * (len(episode.turns) - 1)
    assert episode.weight_version == 4
    episode.check()
    for turn in episode.turns:  # the trained tokens are exactly each turn's generated span
        assert set(episode.turn_index[turn.start : turn.end]) == {turn.index}
    model = AutoModelForCausalLM.from_pretrained(chatty, dtype=torch.float32)
    check_logprobs(episode, model)


async def _waiting(url: str, key: str) -> bool:
    return (await server_state(url, key))["waiting"] >= 1
