"""The conversational tau2 gyms over real HTTP: the real UserSimulator against the local test server.

Dual control (mock's user tools), tau2's termination reasons, the NL-assertion judge, simulator failures, the
gyms' task sources, and the first user message reaching the policy's prompt in the episode runner.
"""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gyms.base import StepResult, make_gym
from gyms.data import NoSuchSplitError
from gyms.smoke import ScriptedUserSim, SmokeEpisode, run_episode
from gyms.tau.gym import INVALID_TOOL_CALL
from gyms.tau.user import GREETING
from gyms.tau2.domain import load_domain
from gyms.tau2.gym import AGENT_INSTRUCTIONS, Tau2ChatGym, chat_tasks
from gyms.tau2.judge import JUDGE_SYSTEM
from gyms.tau2.settings import Tau2GymConfig
from gyms.tau2.user import TOOL_RESULT
from gyms.turn_gym import TurnGym
from gyms.user_sim import UserSimError, UserSimulator
from tests.support.gym_play import SIM_TIMEOUT_S
from tests.support.openai_server import Fault, OpenAIServer, reply
from userrl_megatron.config.schema import GymsConfig, UserSimConfig
from userrl_megatron.data import load_tasks

Rule = Any


def user_says(message: str) -> str:
    return json.dumps({"message": message, "tool_call": None})


def user_calls(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"message": "", "tool_call": {"name": name, "arguments": arguments}})


def after(last: str, answer: str, prefix: bool = False) -> Rule:
    """`answer` when the request's last message is `last` (or starts with it)."""

    def rule(body: dict[str, Any]) -> str | None:
        content = str(body["messages"][-1]["content"])
        return answer if (content.startswith(last) if prefix else content == last) else None

    return rule


def judged(*met: bool) -> Rule:
    """The judge's grades, in order, for a request whose system prompt is the judge's."""
    results = [{"expectedOutcome": f"outcome {i}", "reasoning": "read it", "metExpectation": m} for i, m in
               enumerate(met)]  # fmt: skip
    return lambda body: json.dumps({"results": results}) if body["messages"][0]["content"] == JUDGE_SYSTEM else None


def call(name: str, **arguments: Any) -> str:
    return "[answer] " + json.dumps({"name": name, "arguments": arguments})


def play(
    gym_name: str,
    task_id: str,
    actions: list[str],
    server: OpenAIServer,
    data: Path,
    structured: str = "auto",
    **settings: Any,
) -> tuple[Tau2ChatGym, str, list[StepResult]]:
    """Reset a fresh gym with a UserSimulator pointed at `server`, play `actions`; (gym, opening, results)."""
    cfg = UserSimConfig(base_url=server.base_url, model="user", timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=1)
    cfg.api_key_env, cfg.structured = "none", structured

    async def run() -> tuple[Tau2ChatGym, str, list[StepResult]]:
        sim = UserSimulator(cfg)
        gym = make_gym(gym_name, task_id, Tau2GymConfig(data_dir=str(data), **settings), sim)
        assert isinstance(gym, Tau2ChatGym)
        try:
            opening = await gym.reset()
            results = []
            for action in actions:
                results.append(await gym.step(action))
                if results[-1].ended or results[-1].user_sim_error:
                    break
            return gym, opening, results
        finally:
            await gym.close()
            await sim.close()

    return asyncio.run(run())


def test_dual_control_user_tools_change_the_user_db_and_its_hash(shared_data: Path) -> None:
    """Mock's user checks its notifications, asks for task_1, then dismisses the notification and stops."""
    done = "Done: task_1 is completed."
    with OpenAIServer(
        after(GREETING, user_calls("check_notifications", {})),
        after("Result of your tool call check_notifications", user_says("I finished task_1, mark it done."), True),
        after(done, user_calls("dismiss_notification", {"notification_id": "notif_1"})),
        after("Result of your tool call dismiss_notification", user_says("Thanks! ###STOP###"), True),
    ) as server:
        update = call("update_task_status", task_id="task_1", status="completed")
        gym, opening, results = play(
            "tau2_mock_chat", "update_task_with_user_tools", [update, f"[action] {done}"], server, shared_data
        )
        requests = server.requests
    assert opening == "I finished task_1, mark it done."
    first = requests[0]
    assert first["response_format"]["json_schema"]["name"] == "tau2_user"  # schema-constrained (structured: auto)
    system = first["messages"][0]["content"]
    assert system.startswith("# User Simulation Guidelines") and "You have some tools" in system
    assert "<scenario>" in system and "check_notifications" in system and "dismiss_notification" in system
    assert first["messages"][1:] == [{"role": "user", "content": GREETING}]
    # the user's tool results reach the simulator only; the agent sees the messages
    notifications = (
        load_domain("mock", str(shared_data / "tau2")).new_env(gym.task).call("check_notifications", {}, "user")
    )
    assert requests[1]["messages"][-1]["content"] == TOOL_RESULT.format(
        name="check_notifications", content=notifications.content
    )
    assert [m["role"] for m in gym.user.history] == ["system"] + ["user", "assistant"] * 4
    assert (results[0].feedback, results[0].reward, results[0].done) == (
        json.dumps({"task_id": "task_1", "title": "Test task", "description": "A test task", "status": "completed"}),
        0.0,
        False,
    )
    # the user's calls before its first message are named by the first step (reset() returns only the message)
    assert results[0].info["opening_user_tool_calls"] == ["check_notifications"]
    last = results[1]
    assert (last.feedback, last.done, last.info["termination_reason"]) == ("Thanks! ###STOP###", True, "user_stop")
    assert last.info["user_tool_calls"] == ["dismiss_notification"] and "opening_user_tool_calls" not in last.info
    assert gym.calls == [
        ("check_notifications", {}),
        ("update_task_status", {"task_id": "task_1", "status": "completed"}),
        ("dismiss_notification", {"notification_id": "notif_1"}),
    ]
    assert gym.env.user_db is not None and gym.env.user_db["notifications"]["notif_1"]["status"] == "read"
    # upstream's fixture quirk (SPEC.md §12): the gold user DB keeps the notification unread, the assertion wants it
    # read, so DB fails exactly where ENV_ASSERTION passes; the reward is 0
    domain = load_domain("mock", str(shared_data / "tau2"))
    gold_db, gold_user = domain.gold_hashes(gym.task)
    assert gym.env.db.hash() == gold_db and gym.env.user_db.hash() != gold_user
    replay = domain.new_env(gym.task)
    replay.call("update_task_status", {"task_id": "task_1", "status": "completed"})
    replay.call("dismiss_notification", {"notification_id": "notif_1"}, requestor="user")
    assert gym.env.hashes() == replay.hashes()
    assert last.reward == 0.0
    assert last.info["reward_info"]["components"] == {"DB": 0.0, "ACTION": 1.0, "ENV_ASSERTION": 1.0}


def test_a_message_history_is_continued_by_both_parties(shared_data: Path) -> None:
    """Mock's task whose conversation began earlier (task_2 created): the policy's prompt continues it (the texts,
    the agent's call and its result); the simulated user sees the texts, roles flipped, and answers the agent's last
    message at reset. The earlier call counts for ACTION, the earlier texts for the judge's transcript."""
    task_id = "update_task_with_message_history"
    history = load_domain("mock", str(shared_data / "tau2")).task(task_id)["initial_state"]["message_history"]
    first, created = history[0]["content"], history[-1]["content"]
    [row] = [t for t in chat_tasks("tau2_mock_chat", "base", shared_data) if t.task_id == task_id]
    assert [m.role for m in row.prompt] == ["system", "user", "assistant", "tool", "assistant"]
    assert row.prompt[1].content == first and row.prompt[4].content == created
    create = history[1]["tool_calls"][0]
    function = {"name": "create_task", "arguments": json.dumps(create["arguments"])}  # a string, as OpenAI's
    assert row.prompt[2].tool_calls == [{"id": "call_1", "type": "function", "function": function}]
    assert (row.prompt[3].content, row.prompt[3].tool_call_id) == (history[2]["content"], "call_1")
    done = "Done: task_2 is completed."
    with OpenAIServer(
        after(created, user_says("Now please mark task_2 as completed.")),
        after(done, user_says("Thanks! ###STOP###")),
    ) as server:
        update = call("update_task_status", task_id="task_2", status="completed")
        gym, opening, results = play("tau2_mock_chat", task_id, [update, f"[action] {done}"], server, shared_data)
        requests = server.requests
    assert opening == "Now please mark task_2 as completed."
    assert requests[0]["messages"][1:] == [
        {"role": "assistant", "content": user_says(first)},  # the user's own words, as it writes them
        {"role": "user", "content": created},
    ]
    assert gym.calls == [("create_task", create["arguments"]), ("update_task_status", {"task_id": "task_2",
                         "status": "completed"})]  # fmt: skip
    assert gym.transcript[:3] == [("user", first), ("assistant", created), ("user", opening)]
    last = results[-1]
    assert (last.reward, last.info["termination_reason"]) == (1.0, "user_stop")


def test_a_plain_text_user_and_the_agents_stop(shared_data: Path) -> None:
    """Retail's user has no tools: free text, no schema. The agent's ###STOP### ends the episode, scored."""
    with OpenAIServer(after(GREETING, "Hi, which t-shirts did I order?"), judged(True)) as server:
        _, opening, results = play(
            "tau2_retail", "24", ["[action] Polyester and cotton ones. ###STOP###"], server, shared_data
        )
        requests = server.requests
    assert opening == "Hi, which t-shirts did I order?"
    assert len(requests) == 1 and "response_format" not in requests[0]  # no judge: nl_judge is off
    system = requests[0]["messages"][0]["content"]
    assert "You have some tools" not in system and "Reason for call: You want to cancel the grill" in system
    result = results[0]
    assert (result.reward, result.done, result.info["termination_reason"]) == (1.0, True, "agent_stop")
    assert result.info["reward_info"]["components"] == {"DB": 1.0}
    assert result.info["reward_info"]["unscored"] == ["NL_ASSERTION"]


@pytest.mark.parametrize(("met", "reward"), [(True, 1.0), (False, 0.0)])
def test_the_nl_judge_scores_nl_assertions(shared_data: Path, met: bool, reward: float) -> None:
    with OpenAIServer(judged(met), after(GREETING, "Which t-shirts did I order?")) as server:
        _, _, results = play(
            "tau2_retail", "24", ["[action] Polyester and cotton. ###STOP###"], server, shared_data, nl_judge=True
        )
        judge = server.requests[-1]
    assert judge["response_format"]["json_schema"]["name"] == "tau2_nl_judge"
    assert judge["response_format"]["json_schema"]["schema"]["properties"]["results"]["minItems"] == 1
    conversation = judge["messages"][1]["content"]
    assert f"assistant: {GREETING}\nuser: Which t-shirts did I order?\nassistant: Polyester" in conversation
    assert "1. Agent should tell the user the materials of the two t-shirts are polyester and cotton." in conversation
    info = results[0].info["reward_info"]
    assert (results[0].reward, info["components"], info["unscored"]) == (
        reward,
        {"DB": 1.0, "NL_ASSERTION": reward},
        [],
    )
    assert [(r["met"], r["reasoning"]) for r in info["nl_assertions"]] == [(met, "read it")]


def test_a_judge_reply_that_grades_too_few_is_a_simulator_error(shared_data: Path) -> None:
    with OpenAIServer(judged(), after(GREETING, "Hello.")) as server:
        _, _, results = play("tau2_retail", "24", ["[action] Bye ###STOP###"], server, shared_data, nl_judge=True)
    assert results[0].user_sim_error is not None and "does not grade the 1 assertions" in results[0].user_sim_error
    assert (results[0].reward, results[0].info["termination_reason"]) == (0.0, "infrastructure_error")


def test_too_many_errors_ends_with_reward_0(shared_data: Path) -> None:
    with OpenAIServer(after(GREETING, user_says("Hello."))) as server:
        bad = call("no_such_tool")
        _, _, results = play("tau2_mock_chat", "create_task_1", [bad, bad, bad], server, shared_data, max_errors=2)
    assert [r.feedback for r in results] == ["Error: Tool 'no_such_tool' not found."] * 2
    assert (results[1].reward, results[1].done, results[1].info["termination_reason"]) == (0.0, True, "too_many_errors")


def test_max_steps_ends_with_reward_0(shared_data: Path) -> None:
    create = call("create_task", user_id="user_1", title="Important Meeting")
    with OpenAIServer(after(GREETING, user_says("Create 'Important Meeting' for user_1."))) as server:
        _, _, results = play("tau2_mock_chat", "create_task_1", [create, create], server, shared_data, max_steps=1)
    assert len(results) == 1
    assert (results[0].reward, results[0].truncated, results[0].info["termination_reason"]) == (0.0, True, "max_steps")


def test_bad_actions_get_feedback_and_change_nothing(shared_data: Path) -> None:
    with OpenAIServer(after(GREETING, user_says("Hello."))) as server:
        gym, _, results = play(
            "tau2_mock_chat", "create_task_1", ["[answer] {not json", "[action]  ", "[search] tools", "hello"],
            server, shared_data,
        )  # fmt: skip
        assert server.count == 1  # the opening only
    assert results[0].feedback == INVALID_TOOL_CALL
    assert [r.feedback.split(":")[0] for r in results[1:]] == ["Invalid action"] * 3
    assert [r.reward for r in results] == [0.0] * 4 and not any(r.ended for r in results)
    assert gym.calls == [] and gym.errors == 0 and gym.said == []


def test_a_failed_simulator_is_an_infrastructure_error_that_leaves_the_conversation(shared_data: Path) -> None:
    answers: Iterator[str | Fault] = iter([user_says("Hello."), Fault(500), Fault(500)])
    with OpenAIServer(lambda body: next(answers)) as server:
        gym, _, results = play("tau2_mock_chat", "create_task_1", ["[action] How can I help?"], server, shared_data)
    failed = results[0]
    assert (failed.feedback, failed.reward, failed.done) == (TurnGym.fallback_feedback, 0.0, False)
    assert "HTTP 500" in (failed.user_sim_error or "")
    assert failed.info["termination_reason"] == "infrastructure_error"
    assert len(gym.user.history) == 3 and gym.said == []  # the agent's message was never heard


@pytest.mark.parametrize(
    "answer",
    [
        user_calls("delete_everything", {}),  # not one of the user's tools
        json.dumps({"message": "", "tool_call": None}),  # nothing said
        "no JSON at all",
    ],
)
def test_an_unusable_user_reply_is_a_simulator_error(shared_data: Path, answer: str) -> None:
    with OpenAIServer(reply(answer)) as server:
        cfg = UserSimConfig(base_url=server.base_url, timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=0)
        cfg.api_key_env = "none"

        async def run() -> None:
            sim = UserSimulator(cfg)
            gym = make_gym("tau2_mock_chat", "create_task_1", Tau2GymConfig(data_dir=str(shared_data)), sim)
            try:
                with pytest.raises(UserSimError):
                    await gym.reset()
            finally:
                await sim.close()

        asyncio.run(run())


def test_task_sources_name_the_splits(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train = load_tasks(["tau2_retail:train"], "test", cfg)
    splits = json.loads((shared_data / "tau2/retail/split_tasks.json").read_text())
    assert [t.task_id for t in train] == splits["train"] and len(train) == 74
    assert (
        len(load_tasks(["tau2_airline"], "test", cfg)) == 20 and len(load_tasks(["tau2_airline:base"], "x", cfg)) == 50
    )
    task = load_tasks(["tau2_mock_chat:base"], "train", cfg)[0]
    assert [m.role for m in task.prompt] == ["system", "assistant"] and task.prompt[1].content == GREETING
    assert (
        task.prompt[0].content.startswith(AGENT_INSTRUCTIONS)
        and "<policy>\n# Mock Domain Policy" in task.prompt[0].content
    )
    assert [t["function"]["name"] for t in task.tools] == ["create_task", "get_users", "update_task_status",
                                                           "transfer_to_human_agents"]  # fmt: skip
    assert task.metadata["reply_without_tool_call"] == "action"
    with pytest.raises(NoSuchSplitError, match="tau2_mock_chat has no 'train' split"):
        load_tasks(["tau2_mock_chat"], "train", cfg)


def test_telecom_the_user_fixes_the_phone_by_its_own_tool_call(shared_data: Path) -> None:
    """Telecom's gold path is the user's: roaming on (dual control); the env assertions then pass: reward 1."""
    task_id = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"
    ask = "Please turn on data roaming on your phone."
    with OpenAIServer(
        after(GREETING, user_says("My mobile data does not work abroad.")),
        after(ask, user_calls("toggle_roaming", {})),
        after("Result of your tool call toggle_roaming", user_says("Done, data works now. ###STOP###"), True),
    ) as server:
        domain = load_domain("telecom", str(shared_data / "tau2"))
        before = domain.new_env(domain.task(task_id)).hashes()
        gym, _, results = play("tau2_telecom", task_id, [f"[action] {ask}"], server, shared_data)
        schema = server.requests[0]["response_format"]["json_schema"]["schema"]
    variants = schema["properties"]["tool_call"]["anyOf"]
    assert len(variants) == 1 + 30 and variants[0] == {"type": "null"}  # null, or one of the 30 phone tools
    jsonschema.Draft202012Validator.check_schema(schema)
    assert "$ref" not in json.dumps(schema)  # each tool's `$defs` inlined: the schema stands alone
    mode = {"message": "", "tool_call": {"name": "set_network_mode_preference", "arguments": {"mode": "4g_only"}}}
    assert jsonschema.Draft202012Validator(schema).is_valid(mode)
    assert not jsonschema.Draft202012Validator(schema).is_valid({**mode, "tool_call": {"name": "rm", "arguments": {}}})
    last = results[0]
    assert (last.reward, last.done, last.info["termination_reason"]) == (1.0, True, "user_stop")
    assert last.info["reward_info"]["components"] == {"ENV_ASSERTION": 1.0}
    assert gym.calls == [("toggle_roaming", {})] and last.info["user_tool_calls"] == ["toggle_roaming"]
    after_db, after_user = gym.env.hashes()
    assert after_db == before[0] and after_user != before[1]  # only the phone (the user's DB) changed


def test_a_user_who_stops_before_the_agent_speaks_is_a_simulator_error(shared_data: Path) -> None:
    stops = after(GREETING, "Never mind. ###STOP###")
    with OpenAIServer(stops) as server, pytest.raises(UserSimError, match="ended the conversation at once"):
        play("tau2_retail", "24", [], server, shared_data)


def test_a_smoke_episode_whose_reset_fails_reports_it(shared_data: Path) -> None:
    """`userrl gym smoke` reports a simulator that fails the reset as the episode's problem, and goes on."""
    record = {"id": "create_task_1", "tau2_dir": str(shared_data / "tau2")}
    episode = SmokeEpisode("a reset that fails", record, ["[action] Hello?"], [0.0])
    result = asyncio.run(run_episode("tau2_mock_chat", episode, ScriptedUserSim(lambda messages: "no JSON")))
    assert not result.ok and result.problem.startswith("user simulator error at reset:") and result.steps == 0


def test_free_text_user_replies_are_parsed_where_the_engine_gives_no_schema(shared_data: Path) -> None:
    """user_sim.structured=off: no response_format; the user's JSON is read from prose around it."""
    with OpenAIServer(
        after(GREETING, "Let me look first. " + user_calls("check_notifications", {})),
        after("Result of your tool call", f"```json\n{user_says('Task_1 is done, please close it.')}\n```", True),
    ) as server:
        gym, opening, _ = play("tau2_mock_chat", "update_task_with_user_tools", [], server, shared_data, "off")
        assert all("response_format" not in r for r in server.requests)
    assert opening == "Task_1 is done, please close it." and gym.calls == [("check_notifications", {})]


def test_a_user_whose_tool_calls_are_spent_is_asked_for_its_message(shared_data: Path) -> None:
    """After `max_user_tool_calls` calls in one turn, the next request admits a message only (a 135M user called
    phone tools on every schema-constrained request and never spoke: docs/results.md, "tau2 telecom on CPU")."""

    def user(body: dict[str, Any]) -> str:
        if body["response_format"]["json_schema"]["name"] == "tau2_user_message":
            return user_says("My notifications are piling up.")
        return user_calls("check_notifications", {})

    with OpenAIServer(user) as server:
        gym, opening, _ = play("tau2_mock_chat", "create_task_1", [], server, shared_data, max_user_tool_calls=2)
        formats = [r["response_format"]["json_schema"] for r in server.requests]
    assert opening == "My notifications are piling up."
    assert [f["name"] for f in formats] == ["tau2_user", "tau2_user", "tau2_user_message"]
    assert formats[2]["schema"]["properties"]["tool_call"] == {"type": "null"}
    assert gym.opening_calls == ["check_notifications"] * 2


def test_free_text_user_that_keeps_calling_tools_is_a_user_loop(shared_data: Path) -> None:
    """Without a schema (user_sim.structured=off) nothing stops a call after the turn's last one: a simulator error."""
    with OpenAIServer(lambda body: user_calls("check_notifications", {})) as server:
        with pytest.raises(UserSimError, match="more than 2 tool calls") as failure:
            play("tau2_mock_chat", "create_task_1", [], server, shared_data, structured="off", max_user_tool_calls=2)
        assert len(server.requests) == 3 and all("response_format" not in r for r in server.requests)
    assert failure.value.kind == "user_loop"
