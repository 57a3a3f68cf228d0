"""tau2 gold differential test: every mock, airline, retail and telecom task's gold actions, replayed through
gyms.tau2's tools, give upstream's observation text (sha256) and error flag, and reach upstream's gold database
hashes (`<domain>/gold_replay.json`, computed by tau2-bench's own code)."""

import hashlib
import json
from pathlib import Path

import pytest

from gyms.tau2.domain import load_domain
from gyms.tau2.store import RECORD, dump_sorted, reference_hash
from gyms.tau2.toolkit import Observation

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


def test_telecom_initial_state_is_upstreams_dump() -> None:
    domain, gold = load_domain("telecom", str(ROOT)), _gold("telecom")
    env = domain.new_env()
    assert env.user_db is not None
    assert dump_sorted(env.db.to_dict()) == gold["initial_hash_preimage"]["db"]
    assert dump_sorted(env.user_db.to_dict()) == gold["initial_hash_preimage"]["user_db"]
    assert env.hashes() == (gold["initial_db_hash"], gold["initial_user_db_hash"])
    assert len(domain.schemas) == 13 and len(domain.user_schemas) == 30
    assert domain.policy.startswith("<main_policy>\n") and domain.policy.endswith("\n</tech_support_policy>")


def test_telecom_gold_replay_reaches_gold_hashes() -> None:
    """All 2,285 tasks, both requestors. Each call is followed by the sync, as in a live episode; the result is
    upstream's synced hash. `gold_hashes` replays without sync, as upstream's evaluator, and gives `gold_*`."""
    domain, gold = load_domain("telecom", str(ROOT)), _gold("telecom")
    assert [r["task_id"] for r in gold["tasks"]] == list(domain.tasks)
    wrong, requestors = [], {"a": "assistant", "u": "user"}
    for record in gold["tasks"]:
        task = domain.task(record["task_id"])
        env = domain.new_env(task)
        assert env.hashes() == (record["start_db_hash"], record["start_user_db_hash"]), record["task_id"]
        actions = task["evaluation_criteria"]["actions"]
        assert len(actions) == len(record["actions"])
        for action, (name, requestor, error, sha16, length) in zip(actions, record["actions"], strict=True):
            assert (action["name"], action.get("requestor", "assistant")) == (name, requestors[requestor])
            out = env.call(name, action["arguments"], requestors[requestor])
            got = (hashlib.sha256(out.content.encode()).hexdigest()[:16], len(out.content), out.error)
            if got != (sha16, length, bool(error)):
                wrong.append((record["task_id"], name, out.content[:120]))
        synced = (
            record["gold_synced_db_hash"] or record["gold_db_hash"],
            record["gold_synced_user_db_hash"] or record["gold_user_db_hash"],
        )
        assert env.hashes() == synced, record["task_id"]
        assert domain.gold_hashes(task) == (record["gold_db_hash"], record["gold_user_db_hash"]), record["task_id"]
    assert not wrong, wrong[:5]
    assert sum(len(r["actions"]) for r in gold["tasks"]) == gold["totals"]["gold_actions"] == 13215
    assert sum(r["gold_synced_user_db_hash"] is not None for r in gold["tasks"]) > 0


def test_incremental_hash_equals_full_dump_after_writes() -> None:
    domain = load_domain("retail", str(ROOT))
    task = domain.task(next(t for t in domain.tasks if domain.tasks[t]["evaluation_criteria"].get("actions")))
    env = domain.new_env(task)
    for action in task["evaluation_criteria"]["actions"]:
        env.call(action["name"], action.get("arguments", {}))
    assert env.db.hash() == reference_hash(env.db.to_dict())
    telecom = load_domain("telecom", str(ROOT))
    task = telecom.task("[service_issue]overdue_bill_suspension[PERSONA:Easy]")
    env = telecom.new_env(task)  # appends a bill to a list table, edits the phone and its surroundings
    assert env.user_db is not None and len(env.db["bills"]) == 7
    for action in task["evaluation_criteria"]["actions"]:
        env.call(action["name"], action["arguments"], action["requestor"])
    assert env.db.hash() == reference_hash(env.db.to_dict())
    assert env.user_db.hash() == reference_hash(env.user_db.to_dict())


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
        (
            "telecom",
            "get_customer_by_id",
            {},
            "Error: TelecomTools.get_customer_by_id() missing 1 required positional argument: 'customer_id'",
        ),
        ("telecom", "get_customer_by_id", {"customer_id": "C9"}, "Error: Customer with ID C9 not found"),
        ("telecom", "get_customer_by_phone", {"phone_number": "1"}, "Error: Customer with phone number 1 not found"),
        ("telecom", "get_customer_by_name", {"full_name": "JOHN SMITH", "dob": "1985-06-16"}, "[]"),
        ("telecom", "get_details_by_id", {"id": "X1"}, "Error: Unknown ID format or type: X1"),
        ("telecom", "get_details_by_id", {"id": "L9"}, "Error: Line with ID L9 not found"),
        ("telecom", "get_details_by_id", {"id": "P9"}, "Error: Plan with ID P9 not found"),
        (
            "telecom",
            "get_data_usage",
            {"customer_id": "C1001", "line_id": "L1004"},
            "Error: Line L1004 not found for customer C1001",
        ),
        (
            "telecom",
            "suspend_line",
            {"customer_id": "C1001", "line_id": "L1003", "reason": "r"},
            "Error: Line must be active to suspend",
        ),
        (
            "telecom",
            "resume_line",
            {"customer_id": "C1001", "line_id": "L1002"},
            "Error: Line must be suspended to resume",
        ),
        (
            "telecom",
            "send_payment_request",
            {"customer_id": "C1001", "bill_id": "B1004"},
            "Error: Bill B1004 not found for customer C1001",
        ),
        ("telecom", "enable_roaming", {"customer_id": "C1001", "line_id": "L1002"}, "Roaming was already enabled"),
        ("telecom", "disable_roaming", {"customer_id": "C1001", "line_id": "L1001"}, "Roaming was already disabled"),
        (
            "telecom",
            "refuel_data",
            {"customer_id": "C1001", "line_id": "L1003", "gb_amount": 0},
            "Error: Refuel amount must be positive",
        ),
    ],
)
def test_tool_errors_as_spec(name: str, tool: str, arguments: dict, expected: str) -> None:
    env = load_domain(name, str(ROOT)).new_env()
    before = env.db.hash()
    out = env.call(tool, arguments)
    assert out.content == expected
    assert out.error == expected.startswith("Error: ")
    assert env.db.hash() == before


def test_telecom_reads_as_spec() -> None:
    """Read tools' exact texts (no gold action reads): lookups, usage with numbers as strings, the phone's checks."""
    domain = load_domain("telecom", str(ROOT))
    env = domain.new_env()
    usage = env.call("get_data_usage", {"customer_id": "C1001", "line_id": "L1002"}).content
    assert usage == (
        '{"line_id": "L1002", "data_used_gb": "8.7", "data_limit_gb": "15.0", "data_refueling_gb": "0.0", '
        '"cycle_end_date": "2025-02-28"}'
    )
    plan = env.call("get_details_by_id", {"id": "P1002"}).content
    assert plan == (
        '{"plan_id": "P1002", "name": "Premium Plan", "data_limit_gb": 15.0, "price_per_month": 65.0, '
        '"data_refueling_price_per_gb": 2.0}'
    )
    device = json.loads(env.call("get_details_by_id", {"id": "D1001"}).content)
    assert device["activation_date"] == "2025-01-20 14:30:00" and device["last_esim_transfer_date"] is None
    bills = json.loads(env.call("get_bills_for_customer", {"customer_id": "C1001", "limit": 2}).content)
    assert [b["bill_id"] for b in bills] == ["B1003", "B1002"]
    by_phone = env.call("get_customer_by_phone", {"phone_number": "555-123-2003"}).content
    assert json.loads(by_phone)["customer_id"] == "C1001"
    found = json.loads(env.call("get_customer_by_name", {"full_name": "john smith", "dob": "1985-06-15"}).content)
    assert [c["customer_id"] for c in found] == ["C1001"]

    def user(name: str, **arguments: object) -> str:
        out = env.call(name, arguments, "user")
        assert not out.error, out.content
        return out.content

    assert user("check_status_bar") == "Status Bar: 📶³ Good | 5G | 📱 Data Enabled | 🔋 80%"
    assert user("run_speed_test") == "Speed Test Result: 220.00 Mbps (Excellent). Connection is very fast."
    assert user("check_network_status") == (
        "Airplane Mode: OFF\nSIM Card Status: active\nCellular Connection: connected\nCellular Signal: good\n"
        "Cellular Network Type: 5G\nMobile Data Enabled: Yes\nData Roaming Enabled: No\nWi-Fi Radio: OFF\n"
        "Wi-Fi Connected: No"
    )
    assert (
        user("check_app_permissions", app_name="messaging")
        == "App 'messaging' has permission for: sms, storage, phone."
    )
    assert user("check_app_status", app_name="camera") == "App 'camera' not found on this phone."
    assert user("check_installed_apps") == "The following apps are installed on the phone: messaging, browser"
    assert user("set_network_mode_preference", mode="5g_only") == (
        "Failed to set network mode: '5g_only' is not a valid option. Please use one of: 4g_5g_preferred, 4g_only, "
        "3g_only, 2g_only\nStatus Bar: 📶³ Good | 5G | 📱 Data Enabled | 🔋 80%"
    )
    assert user("grant_app_permission", app_name="browser", permission="Camera").startswith(
        "Error. Permission 'camera' not tracked for app 'browser', available permissions: ['sms', 'storage', "
    )
    assert user("set_network_mode_preference", mode="3g_only") == (
        "Preferred Network Mode set to: 3g_only\nStatus Bar: 📶² Fair | 3G | 📱 Data Enabled | 🔋 80%"
    )
    assert user("run_speed_test") == (
        "Speed Test Result: 1.50 Mbps (Poor). Connection is slow. Web browsing may be sluggish, streaming difficult."
    )
    assert (
        user("connect_vpn")
        == "VPN connected successfully.\nStatus Bar: 📶² Fair | 3G | 📱 Data Enabled | 🔒 VPN Connected | 🔋 80%"
    )
    assert user("check_vpn_status") == (
        "VPN is ON and connected. Details: {'server_address': '192.168.1.1', 'protocol': 'OpenVPN', "
        "'server_performance': <PerformanceLevel.EXCELLENT: 'excellent'>}"
    )
    assert user("toggle_airplane_mode") == "Airplane Mode is now ON.\nStatus Bar: ✈️ Airplane Mode | 🔋 80%"
    assert user("check_vpn_status") == "VPN is turned OFF."
    assert (
        user("toggle_wifi")
        == "Cannot change Wi-Fi settings while Airplane Mode is ON.\nStatus Bar: ✈️ Airplane Mode | 🔋 80%"
    )
    assert user("run_speed_test") == "Speed test failed: No Connection."
    assert user("can_send_mms") == "Your messaging app cannot send MMS messages."
    assert user("check_payment_request") == "No payment request has been made."
    assert user("make_payment") == "You do not have a payment request."
    bad_apn = env.call("set_apn_settings", {"apn_settings": {"apn_name": "wap"}}, "user")
    assert bad_apn == Observation("Error: 1 validation error for APNSettings", True)
    assert env.call("get_data_usage", {}, "user").content == "Error: Tool 'get_data_usage' not found."


def test_telecom_sync_mirrors_the_agents_records() -> None:
    """The sync after each call: a payment request appears on the phone, is paid there, and settles the bill at the
    next sync; an agent's roaming change reaches the phone without a network search."""
    domain = load_domain("telecom", str(ROOT))
    env = domain.new_env(domain.task("[service_issue]overdue_bill_suspension[PERSONA:Easy]"))
    assert env.user_db is not None
    around = env.user_db["surroundings"][RECORD]
    assert (around["line_active"], around["payment_request"]) == (False, None)
    sent = env.call("send_payment_request", {"customer_id": "C1001", "bill_id": "B1234321"})
    assert sent.content == "Payment request sent to the customer for bill B1234321"
    assert env.call("check_payment_request", {}, "user").content == (
        "You have a payment request for bill B1234321 of 65.0 USD."
    )
    assert env.call("make_payment", {}, "user").content == "Payment of 65.0 USD has been made for bill B1234321."
    bill = json.loads(env.call("get_details_by_id", {"id": "B1234321"}).content)
    assert bill["status"] == "Paid" and bill["line_items"][0]["description"] == "Charge for line L1002"
    assert env.user_db["surroundings"][RECORD]["payment_request"] is None
    resumed = json.loads(env.call("resume_line", {"customer_id": "C1001", "line_id": "L1002"}).content)
    assert resumed["message"] == "Line resumed successfully" and resumed["line"]["suspension_start_date"] is None
    assert env.user_db["surroundings"][RECORD]["line_active"] is True
    assert env.call("check_status_bar", {}, "user").content == "Status Bar: 📵 No Signal | 📵 Data Disabled | 🔋 80%"
    assert env.call("reboot_device", {}, "user").content == (
        "Restarting network services...\nStatus Bar: 📶⁴ Excellent | 5G | 📱 Data Enabled | 🔋 80%"
    )
    env.call("disable_roaming", {"customer_id": "C1001", "line_id": "L1002"})
    assert env.user_db["surroundings"][RECORD]["roaming_allowed"] is False
