"""tau2 gold differential test: every mock, airline and retail task's gold actions, replayed through gyms.tau2's
tools, give upstream's observation text (sha256) and error flag, and reach upstream's gold database hashes
(`<domain>/gold_replay.json`, computed by tau2-bench's own code)."""

import hashlib
import json
from pathlib import Path

import pytest

from gyms.tau2.domain import load_domain
from gyms.tau2.store import reference_hash

ROOT = Path(__file__).resolve().parents[3] / "shared" / "data" / "tau2"
pytestmark = pytest.mark.skipif(not ROOT.is_dir(), reason=f"tau2 data not at {ROOT}")


def _gold(domain: str) -> dict:
    return json.loads((ROOT / domain / "gold_replay.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["mock", "airline", "retail"])
def test_gold_replay_reaches_gold_hashes(name: str) -> None:
    domain, gold = load_domain(name, str(ROOT)), _gold(name)
    env = domain.new_env()
    assert env.db.hash() == gold["initial_db_hash"] == reference_hash(env.db.to_dict())
    if gold["initial_user_db_hash"] is not None:
        assert env.user_db is not None and env.user_db.hash() == gold["initial_user_db_hash"]
    assert [r["task_id"] for r in gold["tasks"]] == list(domain.tasks)
    wrong = []
    for record in gold["tasks"]:
        task = domain.task(record["task_id"])
        env = domain.new_env(task)
        assert env.db.hash() == record["start_db_hash"], record["task_id"]
        actions = task["evaluation_criteria"].get("actions") or []
        assert len(actions) == len(record["actions"])
        for action, expected in zip(actions, record["actions"], strict=True):
            out = env.call(action["name"], action.get("arguments", {}), action.get("requestor", "assistant"))
            got = (hashlib.sha256(out.content.encode()).hexdigest(), len(out.content), out.error)
            if got != (expected["observation_sha256"], expected["observation_len"], expected["error"]):
                wrong.append((record["task_id"], action["name"], out.content[:120], expected["observation_head"]))
        assert env.db.hash() == record["gold_db_hash"], record["task_id"]
        assert domain.gold_hashes(task)[0] == record["gold_db_hash"]
    assert not wrong, wrong[:5]
    errors = sum(r["n_action_errors"] for r in gold["tasks"])
    assert errors == gold["totals"]["gold_actions_returning_error"]


def test_incremental_hash_equals_full_dump_after_writes() -> None:
    domain = load_domain("retail", str(ROOT))
    task = domain.task(next(t for t in domain.tasks if domain.tasks[t]["evaluation_criteria"].get("actions")))
    env = domain.new_env(task)
    for action in task["evaluation_criteria"]["actions"]:
        env.call(action["name"], action.get("arguments", {}))
    assert env.db.hash() == reference_hash(env.db.to_dict())


@pytest.mark.parametrize(
    ("name", "tool", "arguments", "expected"),
    [
        (
            "airline",
            "get_user_details",
            {},
            "Error: AirlineTools.get_user_details() missing 1 required positional argument: 'user_id'",
        ),
        ("airline", "get_user_details", {"user_id": "nobody"}, "Error: User nobody not found"),
        ("airline", "no_such_tool", {}, "Error: Tool 'no_such_tool' not found."),
        ("airline", "calculate", {"expression": "2 + 2"}, "4.0"),
        ("airline", "calculate", {"expression": "2 ** x"}, "Error: Invalid characters in expression"),
        ("airline", "get_flight_status", {"flight_number": "HAT018", "date": "2024-05-11"}, "delayed"),
        (
            "airline",
            "get_flight_status",
            {"flight_number": "HAT001", "date": "2024-06-01"},
            "Error: Flight HAT001 not found on date 2024-06-01",
        ),
        (
            "airline",
            "update_reservation_baggages",
            {"reservation_id": "NOPE00", "total_baggages": 1, "nonfree_baggages": 0, "payment_id": "x"},
            "Error: Reservation NOPE00 not found",
        ),
        ("airline", "send_certificate", {"user_id": "nobody", "amount": 50}, "Error: User nobody not found"),
        ("retail", "get_order_details", {"order_id": "#W0"}, "Error: Order not found"),
        ("retail", "get_item_details", {"item_id": "0"}, "Error: Item not found"),
        ("retail", "find_user_id_by_email", {"email": "none@example.com"}, "Error: User not found"),
        ("retail", "transfer_to_human_agents", {"summary": "s"}, "Transfer successful"),
        ("mock", "update_task_status", {"task_id": "task_9", "status": "completed"}, "Error: Task task_9 not found"),
        ("mock", "create_task", {"user_id": "user_9", "title": "t"}, "Error: User user_9 not found"),
    ],
)
def test_tool_errors_as_spec(name: str, tool: str, arguments: dict, expected: str) -> None:
    env = load_domain(name, str(ROOT)).new_env()
    before = env.db.hash()
    out = env.call(tool, arguments)
    assert out.content == expected
    assert out.error == expected.startswith("Error: ")
    assert env.db.hash() == before
