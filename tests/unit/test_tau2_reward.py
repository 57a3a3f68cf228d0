"""tau2 reward on scripted trajectories: the solo mock gym, DB / ACTION / COMMUNICATE components, and telecom's
ENV_ASSERTION / ACTION basis over both parties' tool calls."""

import asyncio
import json
from pathlib import Path

import pytest

from gyms.tau2.domain import Domain, Env, load_domain
from gyms.tau2.solo import Tau2SoloGym

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


def _telecom_sample(domain: Domain) -> list[str]:
    """Every 10th telecom task, and every task scored on ACTION or involving a payment."""
    ids = list(domain.tasks)
    rare = [
        i
        for i, t in domain.tasks.items()
        if "ACTION" in t["evaluation_criteria"]["reward_basis"]
        or any(a["name"] == "make_payment" for a in t["evaluation_criteria"]["actions"])
    ]
    return sorted(set(ids[::10]) | set(rare), key=ids.index)


def _replay(domain: Domain, task: dict, actions: list[dict]) -> tuple[Env, list[tuple[str, dict]]]:
    env, calls = domain.new_env(task), []
    for action in actions:
        env.call(action["name"], action["arguments"], action["requestor"])
        calls.append((action["name"], action["arguments"]))
    return env, calls


def _check_telecom_rewards(domain: Domain, task_ids: list[str]) -> None:
    """Under each task's basis (ENV_ASSERTION, and ACTION for the 32 transfers): the gold actions of both parties
    score 1; no action, or the gold actions less the first, score 0."""
    for task_id in task_ids:
        task = domain.task(task_id)
        actions = task["evaluation_criteria"]["actions"]
        score = domain.score(task, *_replay(domain, task, actions), [])
        basis = task["evaluation_criteria"]["reward_basis"]
        assert (score.reward, score.components) == (1.0, dict.fromkeys(basis, 1.0)), task_id
        assert domain.score(task, domain.new_env(task), [], []).reward == 0.0, task_id
        assert domain.score(task, *_replay(domain, task, actions[1:]), []).reward == 0.0, task_id


def test_telecom_gold_scores_one_and_wrong_trajectories_zero() -> None:
    domain = load_domain("telecom", str(ROOT))
    sample = _telecom_sample(domain)
    assert len(sample) == 265
    _check_telecom_rewards(domain, sample)


@pytest.mark.slow
def test_telecom_rewards_of_every_task() -> None:
    domain = load_domain("telecom", str(ROOT))
    _check_telecom_rewards(domain, list(domain.tasks))


def test_telecom_wrong_fixes_score_zero() -> None:
    domain = load_domain("telecom", str(ROOT))
    task = domain.task("[mobile_data_issue]data_usage_exceeded[PERSONA:Easy]")
    gold = task["evaluation_criteria"]["actions"]
    assert [a["name"] for a in gold] == ["refuel_data"]
    short = [{**gold[0], "arguments": {**gold[0]["arguments"], "gb_amount": 1.0}}]
    score = domain.score(task, *_replay(domain, task, short), [])
    assert (score.reward, score.components) == (0.0, {"ENV_ASSERTION": 0.0})
    transfer = next(t for t in domain.tasks.values() if "ACTION" in t["evaluation_criteria"]["reward_basis"])
    env = domain.new_env(transfer)
    assert domain.score(transfer, env, [], []).components == {"ENV_ASSERTION": 1.0, "ACTION": 0.0}
    called = [("transfer_to_human_agents", {"summary": "any text"})]
    assert domain.score(transfer, env, called, []).reward == 1.0
