"""`userrl eval` and the user simulator: the simulator's identity in results.json and in the episode cache's keys
(an external endpoint, or the engines the run serves), and the client's counters in results.json and report.md.
The managed simulator through the real CLI: tests/e2e/test_managed_simulator_eval.py."""

import json
from pathlib import Path
from typing import Any

from tests.support.openai_server import Answer, OpenAIServer, tool_call
from userrl_megatron.cli import main
from userrl_megatron.eval.evaluation import eval_config, simulator_identity


def test_a_managed_simulator_is_named_by_the_model_it_serves_not_by_the_unused_endpoint() -> None:
    managed = ["user_sim.engines.model=smollm2-135m-instruct", "user_sim.base_url=http://127.0.0.1:9/v1"]
    identity = simulator_identity(eval_config([], managed))
    assert identity == {
        "engines": {"model": "smollm2-135m-instruct", "dtype": eval_config([], []).model.dtype},
        "temperature": 0.0, "max_tokens": 2048, "disable_thinking": False, "structured": "auto",
    }  # fmt: skip
    # Another simulator model is another identity (no cached episode of one is served for the other); the endpoint
    # the managed client does not call is no part of it.
    assert simulator_identity(eval_config([], [*managed, "user_sim.engines.model=qwen3-0.6b"])) != identity
    assert simulator_identity(eval_config([], [*managed, "user_sim.structured=off"])) != identity  # free-text replies
    assert simulator_identity(eval_config([], [*managed, "user_sim.base_url=http://elsewhere/v1"])) == identity
    assert simulator_identity(eval_config([], [*managed, "user_sim.engines.dtype=float32"]))["engines"] == {
        "model": "smollm2-135m-instruct",
        "dtype": "float32",
    }
    external = simulator_identity(eval_config([], ["user_sim.base_url=http://sim/v1", "user_sim.model=m"]))
    assert (external["base_url"], external["model"]) == ("http://sim/v1", "m")  # as before: caches stay valid


def test_the_simulators_calls_are_counted_in_the_results(tmp_path: Path, shared_data: Path) -> None:
    """TelepathyGym against one local server playing both roles: the policy (requests with tools) asks a question
    then guesses; the simulator (requests without tools) answers the question but never writes JSON to the guess,
    so that call fails as `bad_json` after its retry. results.json counts the simulator's calls as the server saw
    them; report.md says how they ended."""
    sim_requests: list[dict[str, Any]] = []

    def both(body: dict[str, Any]) -> Answer:
        if "tools" in body:  # the policy
            asked = body["messages"][-1]["role"] == "tool"
            choice, content = ("answer", "kiwi") if asked else ("action", "Is it a fruit?")
            return tool_call("interact_with_env", {"choice": choice, "content": content})
        sim_requests.append(body)
        if "Is it a fruit?" in body["messages"][-1]["content"]:  # the question
            return Answer(json.dumps({"thought": "t", "response": "Yes", "judgment": "No", "feedback": "noted"}))
        return Answer("I am sorry, I cannot help with that.")  # the guess: no JSON

    out = tmp_path / "telepathy"

    def evaluate(url: str) -> int:
        return main([
            "eval", "--endpoint", url, "--api-model", "policy", "--out", str(out), "--no-plot",
            "--gyms", "telepathy", "--tasks", "1", "--max-turns", "3", "eval.api_key_env=none", "eval.retries=0",
            f"gyms.data_dir={shared_data}", f"user_sim.base_url={url}", "user_sim.model=sim",
            "user_sim.api_key_env=none", "user_sim.max_retries=1", "user_sim.backoff_s=0.01",
        ])  # fmt: skip

    with OpenAIServer(both) as server:
        assert evaluate(server.base_url) == 0
    results = json.loads((out / "results.json").read_text())
    counters = results["user_sim"]
    # The question (one call, answered) and the guess (one call, tried twice, failed as bad_json).
    assert len(sim_requests) == 3
    assert {k: counters[k] for k in ("calls", "answered", "failures", "failures/bad_json", "retries")} == {
        "calls": 2.0, "answered": 1.0, "failures": 1.0, "failures/bad_json": 1.0, "retries": 1.0,
    }  # fmt: skip
    [episode] = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert (episode["finish_reason"], episode["infra_failed"]) == ("user_sim_error", True)
    report = (out / "report.md").read_text()
    assert "- user simulator calls: 2 (1 answered, 0 from the cache, 1 failed, 1 bad_json; 1 retries)" in report
    # A rerun has nothing cached (the failed episode is not cached) and plays it again: its own counters only.
    with OpenAIServer(both) as server:
        assert evaluate(server.base_url) == 0
    assert json.loads((out / "results.json").read_text())["user_sim"]["calls"] == 2.0
