"""tau2's solo mode (gyms.tau2.solo): both tool sets, a user tool run on the user's side, the solo policies, the
tasks upstream's solo agent accepts, and the endings (done, a message, too many errors, the step limit)."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gyms.base import StepResult
from gyms.tau2.domain import load_domain
from gyms.tau2.settings import Tau2GymConfig
from gyms.tau2.solo import SOLO_INSTRUCTIONS, Tau2SoloGym, Tau2TelecomSoloGym, solo_tasks

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
ROOT = DATA / "tau2"
pytestmark = pytest.mark.skipif(not ROOT.is_dir(), reason=f"tau2 data not at {ROOT}")
TELECOM_TASK = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"


def call(name: str, **arguments: Any) -> str:
    return "[answer] " + json.dumps({"name": name, "arguments": arguments})


def gold(domain: str, task_id: str) -> list[str]:
    actions = load_domain(domain, str(ROOT)).task(task_id)["evaluation_criteria"]["actions"]
    return [call(a["name"], **a.get("arguments", {})) for a in actions]


def play(gym: Tau2SoloGym, actions: list[str]) -> list[StepResult]:
    async def run() -> list[StepResult]:
        await gym.reset()
        return [await gym.step(a) for a in actions]

    return asyncio.run(run())


def test_telecom_solo_prompt_and_tools() -> None:
    """The solo instructions and telecom's solo policy (main policy and workflow, tagged as upstream joins them);
    the 13 agent tools, the 30 phone tools and `done`; every task has a ticket and is offered."""
    tasks = solo_tasks("tau2_telecom_solo", "test", DATA)
    assert len(tasks) == 40
    system = tasks[0].prompt[0].content
    assert system.startswith(SOLO_INSTRUCTIONS + "\n\n<policy>\n<main_policy>\n")
    solo_main = (ROOT / "telecom" / "main_policy_solo.md").read_text(encoding="utf-8")
    workflow = (ROOT / "telecom" / "tech_support_workflow_solo.md").read_text(encoding="utf-8")
    assert (
        f"{solo_main}\n</main_policy>\n<tech_support_policy>\n{workflow}\n</tech_support_policy>\n</policy>" in system
    )
    names = [t["function"]["name"] for t in tasks[0].tools]
    assert (len(names), names[-1]) == (44, "done") and "toggle_roaming" in names and "enable_roaming" in names
    task = load_domain("telecom", str(ROOT)).task(tasks[0].task_id)
    assert [m.role for m in tasks[0].prompt] == ["system", "user"] and tasks[0].prompt[1].content == task["ticket"]


def test_telecom_gold_calls_of_both_parties_then_done_score_one() -> None:
    """The agent makes the user's gold calls itself: each runs on the phone (requestor user), and the episode scores
    1; without the user's calls the line stays broken and it scores 0."""
    actions = gold("telecom", TELECOM_TASK)
    steps = play(Tau2TelecomSoloGym({"id": TELECOM_TASK, "tau2_dir": str(ROOT)}), [*actions, call("done")])
    assert [s.info.get("requestor") for s in steps[:-1]] == ["user"] * len(actions)
    assert not any(s.info["tool_error"] for s in steps[:-1])
    assert steps[-1].done and steps[-1].reward == 1.0 and steps[-1].info["termination_reason"] == "agent_stop"
    steps = play(Tau2TelecomSoloGym({"id": TELECOM_TASK, "tau2_dir": str(ROOT)}), [call("done")])
    assert steps[-1].reward == 0.0


def test_telecom_gold_of_the_small_split_scores_one() -> None:
    """Every task of telecom's small split, its gold calls (either party's) then `done`."""
    ids = load_domain("telecom", str(ROOT)).split("small")
    for task_id in ids:
        steps = play(
            Tau2TelecomSoloGym({"id": task_id, "tau2_dir": str(ROOT)}), [*gold("telecom", task_id), call("done")]
        )
        assert steps[-1].reward == 1.0, task_id


def test_mock_offers_the_user_tools_and_the_solo_ready_tasks() -> None:
    """tau2_mock gives the user's tools too, and a call to one runs on the user's side; the two tasks whose message
    history holds user messages, and the task with neither initial state nor gold actions, are not offered."""
    tasks = solo_tasks("tau2_mock", "base", DATA)
    assert [t.task_id for t in tasks] == [
        "create_task_1", "create_task_1_with_env_assertions", "update_task_1", "update_task_with_initialization_data",
        "update_task_with_initialization_actions", "update_task_with_user_tools", "impossible_task_1",
    ]  # fmt: skip
    names = [t["function"]["name"] for t in tasks[0].tools]
    assert names[-3:] == ["check_notifications", "dismiss_notification", "done"]
    record = {"id": "update_task_with_user_tools", "tau2_dir": str(ROOT)}
    update = call("update_task_status", task_id="task_1", status="completed")
    dismiss = call("dismiss_notification", notification_id="notif_1")
    steps = play(Tau2SoloGym(record), [call("check_notifications"), update, dismiss, call("done")])
    assert steps[0].info == {"tool": "check_notifications", "tool_error": False, "requestor": "user", "step": 1}
    assert "notif_1" in steps[0].feedback and steps[2].info["requestor"] == "user"
    # The user-side assertion holds once the notification is dismissed. DB stays 0: upstream's gold user database
    # comes from the gold actions, which leave it unread (SPEC.md §12: a fixture no trajectory can satisfy).
    assert steps[-1].info["reward_info"]["components"] == {"DB": 0.0, "ACTION": 1.0, "ENV_ASSERTION": 1.0}
    undismissed = play(Tau2SoloGym(record), [update, call("done")])[-1].info["reward_info"]["components"]
    assert undismissed["ENV_ASSERTION"] == 0.0


def test_a_message_ends_as_an_agent_error_and_failures_as_too_many_errors() -> None:
    steps = play(Tau2SoloGym({"id": "update_task_1", "tau2_dir": str(ROOT)}), ["[action] Hello?"])
    assert steps[0].done and steps[0].reward == 0.0 and steps[0].info["termination_reason"] == "agent_error"
    gym = Tau2SoloGym({"id": "update_task_1", "tau2_dir": str(ROOT)}, Tau2GymConfig(max_errors=3))
    steps = play(gym, [call("update_task_status", task_id="nope", status="x")] * 3)
    assert [s.done for s in steps] == [False, False, True] and steps[-1].reward == 0.0
    assert steps[-1].info["termination_reason"] == "too_many_errors"
    gym = Tau2SoloGym({"id": "update_task_1", "tau2_dir": str(ROOT)}, Tau2GymConfig(max_steps=2))
    steps = play(gym, [call("get_users")] * 2)
    assert steps[-1].truncated and steps[-1].info["termination_reason"] == "max_steps"
