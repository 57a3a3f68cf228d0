"""`userrl eval` with an OpenAI-compatible endpoint as the policy (a real local HTTP server of ours answering with
scripted tool calls), its outputs (results.json, episodes.jsonl, report.md, a PNG opened back), a rerun served
from the cache, and `--compare` of two finished evaluations."""

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.support.openai_server import Answer, Fault, OpenAIServer, fail_first, tool_call, when
from userrl_megatron.cli import main

ARGS = ["--gyms", "function-procedural", "--tasks", "2", "--max-turns", "3", "eval.api_key_env=none"]
# fgen-test-0-0 asks for [3, 9, 1, 4] (answer 4.0); fgen-test-0-1 for [8, 2, 8, 8] (answer 8.0).


def interact(choice: str, content: str) -> Answer:
    return tool_call("interact_with_env", {"choice": choice, "content": content})


def solver(body: dict[str, Any]) -> Answer:
    """Task 0: probes once, then answers right. Task 1: answers wrong, then writes no tool call."""
    tools = body["messages"][-1]["role"] == "tool"
    if "[3, 9, 1, 4]" in body["messages"][1]["content"]:
        return interact("answer", "4") if tools else interact("action", "1 1 1 1")
    return Answer("I give up.") if tools else interact("answer", "7")


def results_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def test_endpoint_policy_outputs_and_cached_rerun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "api"
    with OpenAIServer(solver) as server:
        args = ["eval", "--endpoint", server.base_url, "--api-model", "scripted", "--out", str(out), *ARGS]
        assert main(args) == 0
        assert server.count == 4  # 2 turns each
        first = server.requests[0]
        assert first["model"] == "scripted" and first["tool_choice"] == "auto" and first["temperature"] == 0.0
        assert [t["function"]["name"] for t in first["tools"]] == ["interact_with_env"]
        (second,) = [r for r in server.requests if r["messages"][-1]["role"] == "tool" and "[3, 9" in str(r)]
        assert second["messages"][-2]["tool_calls"][0]["id"] == "call_1"
        assert second["messages"][-1] == {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "For numbers [1.0, 1.0, 1.0, 1.0], the result is 1.0.",  # no "Reward:" (UserRL's eval)
        }
        results = results_of(out)
        assert results["policy"] == {
            "name": "scripted", "kind": "api", "endpoint": server.base_url, "model": "scripted", "tool_choice": "auto",
        }  # fmt: skip
        function = results["gyms"]["function"]
        assert (function["items"], function["episodes"], function["infra_failed"]) == (2, 2, 0)
        assert function["metrics"] == {"mean": 0.5, "max": 0.5}
        assert function["ci95"]["mean"] == pytest.approx([0.5 - 12.706 * 0.5, 0.5 + 12.706 * 0.5], abs=1e-6)
        assert results["overall"]["score"] == 0.5 and results["episodes_run"] == 2
        assert results["protocol"]["max_turns"] == 3 and results["protocol"]["samples"] == 1
        assert results["simulator"] is None and "openai" in results["versions"]
        episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
        assert [(e["task_id"], e["turn_rewards"], e["finish_reason"]) for e in episodes] == [
            ("fgen-test-0-0", [0.0, 1.0], "done"),
            ("fgen-test-0-1", [0.0, 0.0], "no_tool_call"),  # the reply without a call counts as a turn
        ]
        assert episodes[0]["turns"][1]["action"] == "[answer] 4"
        assert [m["role"] for m in episodes[0]["messages"]] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
        ]
        report = (out / "report.md").read_text()
        assert "| function | 2     | 2        | 0            | 0.500 |" in report
        assert "| function | 2     | 2        | 0            | 0.500 |" in capsys.readouterr().out
        with Image.open(out / "scores.png") as png:
            assert png.format == "PNG" and png.size[0] >= 300 and png.size[1] >= 200

        assert main(args) == 0  # everything cached: the endpoint is not asked again
        assert server.count == 4 and results_of(out)["episodes_cached"] == 2


def test_endpoint_errors_are_infrastructure_failures_retried_then_reported(tmp_path: Path) -> None:
    out = tmp_path / "flaky"
    # 4 client retries of the first request fail (one episode attempt lost), then the endpoint answers.
    with OpenAIServer(fail_first(4, Fault(503), then=solver)) as server:
        args = ["eval", "--endpoint", server.base_url, "--api-model", "m", "--out", str(out), "--no-plot", *ARGS]
        assert main([*args, "--tasks", "1"]) == 0
        episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
        assert [(e["attempts"], e["infra_failed"], e["turn_rewards"]) for e in episodes] == [(2, False, [0.0, 1.0])]
    with OpenAIServer(lambda body: Fault(500)) as server:
        down = tmp_path / "down"
        args = ["eval", "--endpoint", server.base_url, "--api-model", "m", "--out", str(down), "--no-plot", *ARGS]
        assert main([*args, "--tasks", "1", "eval.retries=1"]) == 0
        entry = results_of(down)["gyms"]["function"]
        assert (entry["items"], entry["items_unscored"], entry["episodes"], entry["infra_failed"]) == (0, 1, 1, 1)
        assert entry["metrics"] == {"mean": None, "max": None}  # nothing scored: no score, not an unearned 0
        (episode,) = [json.loads(line) for line in (down / "episodes.jsonl").read_text().splitlines()]
        assert (episode["attempts"], episode["infra_failed"], episode["finish_reason"]) == (2, True, "engine_error")
        assert "Error code: 500" in episode["error"]
        assert results_of(down)["overall"]["score"] is None


def test_compare_two_evaluations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    always = OpenAIServer(when("[3, 9, 1, 4]", interact("answer", "4")), when("[8, 2, 8, 8]", interact("answer", "8")))
    with OpenAIServer(solver) as weak, always as strong:
        for name, server in (("weak", weak), ("strong", strong)):
            out = tmp_path / name
            assert (
                main(
                    ["eval", "--endpoint", server.base_url, "--api-model", name, "--out", str(out), "--no-plot", *ARGS]
                )
                == 0
            )
    capsys.readouterr()
    out = tmp_path / "cmp"
    assert main(["eval", "--compare", str(tmp_path / "weak"), str(tmp_path / "strong"), "--out", str(out)]) == 0
    table = json.loads((out / "compare.json").read_text())["gyms"]["function"]
    assert [r["score"] for r in table] == [0.5, 1.0]
    # paired differences over the same two tasks: 0 and 1 -> mean 0.5, sd 0.7071, t(1) = 12.706
    assert table[1]["difference"] == 0.5 and table[1]["difference_method"] == "paired"
    assert table[1]["difference_ci95"] == pytest.approx([0.5 - 12.706 * 0.5, 0.5 + 12.706 * 0.5], abs=1e-6)
    printed = capsys.readouterr().out
    assert "| function | " in printed and "+0.500" in printed and "baseline" in printed
    with Image.open(out / "compare.png") as png:
        assert png.format == "PNG"


def test_bad_policy_settings_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--endpoint", "http://127.0.0.1:1/v1", "--out", str(tmp_path)]) == 2
    assert "eval.endpoint needs eval.api_model" in capsys.readouterr().err
    assert main(["eval", "--compare", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--compare needs at least two evaluation directories, got 1" in capsys.readouterr().err
    assert main(["eval", "--compare", str(tmp_path), str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert f"{tmp_path} holds no results.json" in capsys.readouterr().err
    args = ["eval", "--endpoint", "http://x/v1", "--api-model", "m", "eval.api_key_env=USERRL_TEST_UNSET_KEY"]
    assert main([*args, "--gyms", "function-procedural", "--out", str(tmp_path / "k")]) == 2
    assert "eval.api_key_env names USERRL_TEST_UNSET_KEY, which is not set" in capsys.readouterr().err


def test_a_simulated_user_gym_with_the_simulator_configured_apart(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TelepathyGym: the policy (requests with tools) asks once then guesses "kiwi"; the simulator (requests
    without tools) says the guess is right only for the Kiwi task. One local server plays both roles."""

    def both(body: dict[str, Any]) -> Answer:
        if "tools" in body:  # the policy
            asked = body["messages"][-1]["role"] == "tool"
            return interact("answer", "kiwi") if asked else interact("action", "Is it a fruit?")
        user = body["messages"][-1]["content"]
        verdict = "Yes" if "Kiwi" in user and "kiwi" in user else "No"
        return Answer(json.dumps({"thought": "t", "response": "Yes", "judgment": verdict, "feedback": "noted"}))

    out = tmp_path / "telepathy"
    with OpenAIServer(both) as server:
        args = [
            "eval", "--endpoint", server.base_url, "--api-model", "policy", "--out", str(out), "--no-plot",
            "--gyms", "telepathy", "--tasks", "2", "--max-turns", "3", "eval.api_key_env=none",
            f"gyms.data_dir={shared_data}", f"user_sim.base_url={server.base_url}", "user_sim.model=sim",
            "user_sim.api_key_env=none",
        ]  # fmt: skip
        assert main(args) == 0
    results = results_of(out)
    assert results["simulator"] == {
        "base_url": server.base_url, "model": "sim", "temperature": 0.0, "max_tokens": 2048, "disable_thinking": False,
        "structured": "auto",
    }  # fmt: skip
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [(e["task_id"], e["turn_rewards"], e["finish_reason"]) for e in episodes] == [
        ("Kiwi", [0.0, 1.0], "done"),
        (episodes[1]["task_id"], [0.0, 0.0, 0.0], "truncated"),
    ]
    assert results["gyms"]["telepathy"]["metrics"] == {"mean": 0.5, "max": 0.5}


def test_tau2_pass_hat_k_over_samples_with_the_first_user_message_from_the_simulator(
    tmp_path: Path, shared_data: Path
) -> None:
    """tau2_mock_chat, 2 tasks x 3 samples. The simulated user asks for a title (one opening in three per task asks
    for the wrong one); the policy creates the task it was asked for and ends with ###STOP###. Gold: 2 of 3."""
    openings = iter(["Important Meeting", "Important Meeting", "Coffee"] * 2)  # one episode at a time

    def both(body: dict[str, Any]) -> Answer:
        messages = body["messages"]
        if "tools" in body:  # the policy: the opening is the last message of its prompt
            if messages[-1]["role"] == "tool":
                return Answer("Created. ###STOP###")
            title = messages[-1]["content"].split("'")[1]
            return tool_call("create_task", {"user_id": "user_1", "title": title})
        message = f"Please create a task '{next(openings)}' for user_1."  # the simulated user's opening
        return Answer(json.dumps({"message": message, "tool_call": None}))

    out = tmp_path / "tau2"
    with OpenAIServer(both) as server:
        args = [
            "eval", "--endpoint", server.base_url, "--api-model", "policy", "--out", str(out), "--no-plot",
            "--gyms", "tau2_mock_chat:base", "--tasks", "2", "--samples", "3", "--max-turns", "4",
            "eval.max_concurrent_episodes=1", "eval.api_key_env=none", f"gyms.data_dir={shared_data}",
            f"user_sim.base_url={server.base_url}",
            "user_sim.model=sim", "user_sim.api_key_env=none",
        ]  # fmt: skip
        assert main(args) == 0
        first_policy_request = next(r for r in server.requests if "tools" in r)
    assert [m["role"] for m in first_policy_request["messages"]] == ["system", "assistant", "user"]
    assert first_policy_request["messages"][1]["content"] == "Hi! How can I help you today?"
    entry = results_of(out)["gyms"]["tau2_mock_chat"]
    assert (entry["items"], entry["episodes"], entry["infra_failed"]) == (2, 6, 0)
    # create_task_1: DB x COMMUNICATE; create_task_1_with_env_assertions: DB x ENV_ASSERTION; both 2 of 3
    assert entry["metrics"]["pass^1"] == pytest.approx(2 / 3, abs=1e-6)
    assert entry["metrics"]["pass^2"] == pytest.approx(1 / 3, abs=1e-6)
    assert entry["metrics"]["pass^3"] == 0.0
    assert entry["ci95"]["pass^1"] == pytest.approx([2 / 3, 2 / 3], abs=1e-6)  # both tasks alike: no spread
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["turns"][-1]["info"][0]["termination_reason"] for e in episodes] == ["agent_stop"] * 6
    components = sorted(json.dumps(e["turns"][-1]["info"][0]["reward_info"]["components"]) for e in episodes)
    wrong = ['{"DB": 0.0, "COMMUNICATE": 1.0}', '{"DB": 0.0, "ENV_ASSERTION": 1.0}']  # task_2 exists, wrong title
    right = ['{"DB": 1.0, "COMMUNICATE": 1.0}'] * 2 + ['{"DB": 1.0, "ENV_ASSERTION": 1.0}'] * 2
    assert components == [*wrong, *right]
