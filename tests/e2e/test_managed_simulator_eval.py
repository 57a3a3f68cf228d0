"""`userrl eval` with the user simulator the run serves (`user_sim.engines`), through the real CLI, with no endpoint
of a simulator and no network: `configs/usersim_cpu.yaml`'s frozen SmolLM2-135M-Instruct engine, started by the
run, is the simulated user of every gym that needs one, UserRL's seven and tau-bench's two domains, one task each.
`user_sim.base_url` names a dead address: every call goes to the engine the run started.

The policy is scripted (a local OpenAI-compatible server of ours, `eval.endpoint`), so that every episode puts
something to the simulator: the config's SmolLM2-135M policy, greedy and with a cheap token limit, has its replies
cut at the limit, and a cut reply is never an action (measured: not one call reached the simulator;
docs/results.md). The simulator's replies are schema-constrained (`user_sim.structured`), but this test caps them
at 48 tokens to stay cheap, so a long reply (Turtle's grades) may be cut and its episode lost to the simulator
(`infra_failed`, unscored); docs/results.md measures the parse rates at the config's own cap. What must hold
whatever it writes: the command succeeds, results.json has an entry for exactly the gyms asked for,
the simulator answered every call one way or the other (its counters in results.json, a call for each episode at
least), and none failed for not reaching it.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.openai_server import Answer, OpenAIServer, tool_call
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Every gym that calls the simulator (gyms.base.gym_spec(...).needs_user_sim): UserRL's (tau is its TauGym) and
# tau-bench's retail and airline domains.
GYMS = ["intention", "persuade", "search", "tau", "telepathy", "travel", "turtle", "tau_retail", "tau_airline"]
DEAD = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there


def test_userrl_eval_scores_every_simulated_user_gym_against_the_managed_simulator(
    shared_data: Path, tmp_path: Path
) -> None:
    # SearchGym's offline backend searches a corpus of ours (UserRL's public data has none; without one every
    # search finds nothing, which would do too); its answers go to the LLM judge (`eval.gym_settings`).
    corpus = tmp_path / "corpus.jsonl"
    docs = [{"title": "Kiwi", "text": "The kiwi is a flightless bird of New Zealand."}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    out = tmp_path / "eval"
    with OpenAIServer(_policy) as policy:
        command = [
            sys.executable, "-m", "userrl_megatron", "eval", "--config", "configs/usersim_cpu.yaml", "--no-plot",
            "--out", str(out), "--gyms", ",".join(GYMS), "--tasks", "1", "--samples", "1", "--max-turns", "1",
            "--endpoint", policy.base_url, "--api-model", "scripted", "eval.api_key_env=none",
            f"gyms.data_dir={shared_data}",
            f"gyms.search.corpus_path={corpus}",
            "gyms.search.judge_max_tokens=48",
            f"user_sim.base_url={DEAD}",  # never called: the client is pointed at the run's own engine
            "user_sim.max_tokens=48",
            "eval.retries=0",  # an episode the judge loses is not played again
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, timeout=RUN_TIMEOUT_S, capture_output=True, text=True)
    (tmp_path / "eval.log").write_text(done.stdout + done.stderr)  # kept: the figures of docs/benchmarks.md
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["gyms"]) == GYMS  # an entry for each gym asked for, and none else
    for gym, entry in results["gyms"].items():
        assert entry["episodes"] == 1, gym
        # Scored, or lost to the simulator (then nothing is scored: no unearned 0).
        assert entry["items"] + entry["infra_failed"] == 1, gym
        assert (entry["metrics"]["mean"] is None) == bool(entry["infra_failed"]), gym
    assert results["simulator"]["engines"]["model"] == "smollm2-135m-instruct"
    assert "base_url" not in results["simulator"]  # the dead address is no part of the simulator's identity

    counters = results["user_sim"]
    assert counters["calls"] >= len(GYMS)  # each episode's one turn put something to the simulator
    assert counters["answered"] + counters["failures"] == counters["calls"]  # no cache: each call ended one way
    assert counters.get("failures/connection", 0.0) == counters.get("retries/connection", 0.0) == 0.0
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["gym"] for e in episodes) == sorted(GYMS)
    for episode in episodes:
        error = episode.get("error") or ""
        assert "cannot reach" not in error and DEAD not in error, error
        assert episode["finish_reason"] in ("user_sim_error", *_SCORED), _summary(episode)
    assert "- user simulator calls: " in (out / "report.md").read_text()


# How an episode that played to its end finishes (no engine or gym failure).
_SCORED = ("done", "truncated", "max_turns", "max_tokens", "no_tool_call", "bad_tool_call")


def _policy(body: dict[str, Any]) -> Answer:
    """Something for the simulator in every gym: an answer for SearchGym's judge (no exact match), a message to the
    user elsewhere (UserRL's gyms: `[action]`; tau-bench's domains: a reply without a tool call, said to the
    customer)."""
    system = str(body["messages"][0]["content"])
    if "SearchGym is a question answering environment" in system:
        return tool_call("interact_with_env", {"choice": "answer", "content": "Paris"})
    if any(t["function"]["name"] == "interact_with_env" for t in body.get("tools") or []):
        return tool_call("interact_with_env", {"choice": "action", "content": "Is it something you can eat?"})
    return Answer("Hello! Could you tell me your user id, please?")


def _summary(episode: dict[str, Any]) -> str:
    return f"{episode['gym']}: {episode['finish_reason']} {episode.get('error')}"
