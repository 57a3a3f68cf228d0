"""`userrl eval` serving an HF directory on the rollout pool (Ray, a real embedded engine server), and the same
evaluation against an already-running engine (`--engine-url`, native API): the two give the same greedy episodes.
A sampled evaluation killed (SIGKILL) mid-run resumes from its cache without losing or repeating an episode."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.chatty import make_chatty_model
from userrl_megatron.cli import main
from userrl_megatron.ports import free_port

pytestmark = pytest.mark.distributed

# One episode at a time: the runs compared here then decode every turn alone. Concurrent episodes share batched
# forwards whose composition depends on timing, and a batch's size can move fp32 logits in their last bits.
SETTINGS = [
    "model.tool_format=tags", "model.max_context_length=4096", "rollout.max_prompt_tokens=2048",
    "rollout.max_response_tokens=128", "rollout.max_new_tokens_per_turn=24", "--gyms", "function-procedural",
    "--tasks", "3", "--max-turns", "2", "--no-plot", "gyms.function.generator.prompt_style=compact",
    "eval.max_concurrent_episodes=1",
]  # fmt: skip


# `userrl eval` that, once HELD_AFTER episodes are cached, holds before caching the next one: the test kills it
# there, mid-run, however fast the episodes go.
HELD_AFTER = 3
HELD_EVAL = f"""
import sys, threading
from userrl_megatron.cli import main
from userrl_megatron.eval.cache import EpisodeCache

put = EpisodeCache.put


def put_or_hold(self, key, record):
    if len(self.records) == {HELD_AFTER}:
        threading.Event().wait()
    put(self, key, record)


EpisodeCache.put = put_or_hold
sys.exit(main(sys.argv[1:]))
"""
DEADLINE_S = 900.0  # Ray, the engine and the first episodes on a busy machine: only a hang takes longer


@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatty_model(tmp_path_factory.mktemp("chatty") / "model")


def episodes(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


def played(out: Path) -> list[tuple[Any, ...]]:
    return [(e["task_id"], e["sample"], [t["text"] for t in e["turns"]], e["turn_rewards"]) for e in episodes(out)]


def test_eval_on_the_pool_and_from_a_running_engine(ray_cluster: object, chatty: Path, tmp_path: Path) -> None:
    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.fleet.launch import launch_embedded

    pool_out = tmp_path / "pool"
    assert main(["eval", "--model", str(chatty), "--out", str(pool_out), *SETTINGS]) == 0
    results = json.loads((pool_out / "results.json").read_text())
    assert results["policy"]["kind"] == "model" and results["policy"]["backend"] == "embedded"
    assert len(results["policy"]["fingerprint"]) == 32
    assert results["gyms"]["function"]["episodes"] == 3 and results["gyms"]["function"]["infra_failed"] == 0
    assert all(e["turns"] and e["response_tokens"] > 0 for e in episodes(pool_out))
    assert (pool_out / "engines" / "engine_0.log").is_file()

    server = launch_embedded(str(chatty), EmbeddedServerConfig(device="cpu"), free_port(), log_path=tmp_path / "s.log")
    try:
        url_out = tmp_path / "url"
        assert main(["eval", "--engine-url", server.url, f"model.path={chatty}", "--out", str(url_out), *SETTINGS]) == 0
    finally:
        server.stop()
    url_results = json.loads((url_out / "results.json").read_text())
    assert url_results["policy"]["kind"] == "engine" and url_results["policy"]["url"] == server.url
    assert played(url_out) == played(pool_out)  # greedy: the same model gives the same episodes either way
    assert url_results["gyms"] == results["gyms"]


def test_a_killed_evaluation_resumes_from_its_cache(ray_cluster: object, chatty: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    sampled = [*SETTINGS, "--samples", "4", "--temperature", "1.0"]
    command = [sys.executable, "-c", HELD_EVAL, "eval", "--model", str(chatty), "--out", str(out), *sampled]
    env = {**os.environ, "RAY_ADDRESS": ""}
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    cache = out / "cache.jsonl"
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not (cache.is_file() and cache.read_text().count("\n") >= HELD_AFTER):  # complete lines
            assert child.poll() is None, "the evaluation ended before it could be killed"
            assert time.monotonic() < deadline, "no episode finished in time"
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the command, its engine server and its Ray workers
        child.wait()
    kept = {json.loads(line)["key"] for line in cache.read_text().splitlines() if line.strip().endswith("}")}
    assert len(kept) == HELD_AFTER
    assert main(["eval", "--model", str(chatty), "--out", str(out), *sampled]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["episodes_cached"] == len(kept) and results["episodes_run"] == 12 - len(kept)
    records = episodes(out)
    assert sorted((r["task_id"], r["sample"]) for r in records) == sorted(
        (f"fgen-test-0-{i}", s) for i in range(3) for s in range(4)
    )
    assert len({r["key"] for r in records}) == 12
    assert len(cache.read_text().splitlines()) == 12  # each episode cached once

    fresh = tmp_path / "fresh"  # sampled with per-episode seeds: an uninterrupted run draws the same episodes
    assert main(["eval", "--model", str(chatty), "--out", str(fresh), *sampled]) == 0
    assert played(fresh) == played(out)


def test_a_megatron_checkpoint_as_policy_is_converted_once(ray_cluster: object, chatty: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "hf2mcore", "--hf", str(chatty), "--out", str(ckpt)]) == 0
    hf_out, ckpt_out = tmp_path / "hf", tmp_path / "mcore"
    assert main(["eval", "--model", str(chatty), "--out", str(hf_out), *SETTINGS]) == 0
    assert main(["eval", "--model", str(ckpt), "--out", str(ckpt_out), *SETTINGS]) == 0
    results = json.loads((ckpt_out / "results.json").read_text())
    converted = Path(results["policy"]["path"])
    assert converted.parent == ckpt_out / "policy_hf" and (converted / "config.json").is_file()
    assert results["policy"]["source"] == str(ckpt)
    assert played(ckpt_out) == played(hf_out)  # the conversion serves the same weights: the same greedy episodes
    mtime = (converted / "config.json").stat().st_mtime_ns
    assert main(["eval", "--model", str(ckpt), "--out", str(ckpt_out), *SETTINGS]) == 0  # cached, not reconverted
    assert (converted / "config.json").stat().st_mtime_ns == mtime
    assert json.loads((ckpt_out / "results.json").read_text())["episodes_cached"] == 3
