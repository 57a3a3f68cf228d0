"""tau2 reward on scripted trajectories: the solo mock gym, and DB / ACTION / COMMUNICATE components."""

import asyncio
import json
from pathlib import Path

import pytest

from gyms.tau2.domain import load_domain
from gyms.tau2.gym import Tau2SoloGym

ROOT = Path(__file__).resolve().parents[3] / "shared" / "data" / "tau2"
pytestmark = pytest.mark.skipif(not ROOT.is_dir(), reason=f"tau2 data not at {ROOT}")


def _play(task_id: str, actions: list[str]) -> list:
    gym = Tau2SoloGym({"id": task_id, "tau2_dir": str(ROOT)})

    async def run() -> list:
        await gym.reset()
        return [await gym.step(a) for a in actions]

    return asyncio.run(run())


def _call(name: str, **arguments: object) -> str:
    return "[answer] " + json.dumps({"name": name, "arguments": arguments})


def test_gold_trajectory_scores_one_and_a_wrong_one_zero() -> None:
    steps = _play("update_task_1", [_call("update_task_status", task_id="task_1", status="completed"), _call("done")])
    assert steps[-1].done and steps[-1].reward == 1.0
    assert steps[-1].info["reward_info"]["components"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    steps = _play("update_task_1", [_call("update_task_status", task_id="task_1", status="pending"), _call("done")])
    assert steps[-1].reward == 0.0


def test_action_basis_and_message_is_agent_error() -> None:
    steps = _play("impossible_task_1", [_call("transfer_to_human_agents", summary="any"), _call("done")])
    assert steps[-1].reward == 1.0  # compare_args [] matches by name
    assert _play("impossible_task_1", [_call("done")])[-1].reward == 0.0
    assert _play("impossible_task_1", ["hello"])[-1].info["error"] == "agent_error"


def test_communicate_and_unscored_nl_assertions() -> None:
    domain = load_domain("airline", str(ROOT))
    task = next(t for t in domain.tasks.values() if t["evaluation_criteria"].get("communicate_info"))
    env = domain.new_env(task)
    calls = [(a["name"], a["arguments"]) for a in task["evaluation_criteria"]["actions"]]
    for name, arguments in calls:
        env.call(name, arguments)
    info = task["evaluation_criteria"]["communicate_info"]
    assert domain.score(task, env, calls, [", ".join(info)]).reward == 1.0
    assert domain.score(task, env, calls, ["nothing"]).reward == 0.0
    retail = load_domain("retail", str(ROOT))
    nl = next(t for t in retail.tasks.values() if "NL_ASSERTION" in t["evaluation_criteria"]["reward_basis"])
    assert retail.score(nl, retail.new_env(nl), [], []).unscored == ["NL_ASSERTION"]
