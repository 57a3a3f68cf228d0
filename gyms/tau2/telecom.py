"""tau2's telecom domain (SPEC.md §3.3, §3.4, §7): dual control over an agent database and the user's phone.

The agent database (`db.toml`) is five list tables: plans, customers, lines, bills and devices. The user database
(`user_db.toml`) is two single records: the phone (`device`) and the world around it (`surroundings`). The agent
has 13 tools over its records; the user has 30 phone tools. `sync` mirrors the agent's line and bills into the
user's surroundings after every executed call, as upstream's `sync_tools`. Tasks call the helpers (fault injection,
setup, assertions) through `initialization_actions` and `env_assertions`.
"""

from pathlib import Path
from typing import Any

from gyms.tau.store import Record
from gyms.tau2.phone import APN_DEFAULTS, DEFAULT_VPN, PERMISSIONS, USER_HELPERS, USER_TOOLS, USER_WRITE_TOOLS
from gyms.tau2.store import RECORD, Shape, Tau2DB
from gyms.tau2.toolkit import ToolFn, toolkit, transfer_to_human_agents

DB_FILE = "db.toml"
USER_DB_FILE = "user_db.toml"
TABLES = ("plans", "customers", "lines", "bills", "devices")
USER_TABLES = ("device", "surroundings")
SHAPES: dict[str, Shape] = {**dict.fromkeys(TABLES, "list"), **dict.fromkeys(USER_TABLES, "record")}

TODAY = "2025-02-25"
CYCLE_END = "2025-02-28"
NEXT_CYCLE = ("2025-03-01", "2025-03-31", "2025-03-15")  # a new draft bill: start, end, due
OVERDUE_CYCLE = ("2025-01-01", "2025-01-31", "2025-01-15")  # the injected overdue bill: start and issue, end, due
ID_FIELD = {
    "plans": "plan_id",
    "customers": "customer_id",
    "lines": "line_id",
    "bills": "bill_id",
    "devices": "device_id",
}
KIND = {"plans": "Plan", "customers": "Customer", "lines": "Line", "bills": "Bill", "devices": "Device"}
PREFIX = {"L": "lines", "D": "devices", "B": "bills", "C": "customers", "P": "plans"}


def policy(folder: Path) -> str:
    """The agent's policy: the main policy and the tech-support manual, tagged as upstream joins them."""
    return _joined(folder, "main_policy.md", "tech_support_manual.md")


def solo_policy(folder: Path) -> str:
    """The solo agent's policy: the solo main policy and the solo tech-support workflow (the manual has none)."""
    return _joined(folder, "main_policy_solo.md", "tech_support_workflow_solo.md")


def _joined(folder: Path, main_file: str, support_file: str) -> str:
    main = (folder / main_file).read_text(encoding="utf-8")
    support = (folder / support_file).read_text(encoding="utf-8")
    return f"<main_policy>\n{main}\n</main_policy>\n<tech_support_policy>\n{support}\n</tech_support_policy>"


# --- records as upstream's models dump them ---


def _pick(raw: Record, fields: tuple[str, ...], defaults: Record | None = None) -> Record:
    defaults = defaults or {}
    return {f: raw.get(f, defaults.get(f)) for f in fields}


def _floats(record: Record, fields: tuple[str, ...]) -> Record:
    for f in fields:
        record[f] = float(record[f])
    return record


def _date(value: Any) -> Any:
    """A date field's dump (`str()` of a date); TOML's native dates become the same string."""
    return value if value is None or isinstance(value, str) else str(value)


def _datetime(value: Any) -> Any:
    """A datetime field's dump: `str()` of a datetime, with a space between date and time."""
    return value if value is None else str(value).replace("T", " ")


def _bill(raw: Record) -> Record:
    fields = ("bill_id", "customer_id", "period_start", "period_end", "issue_date", "total_due", "due_date")
    bill = _floats(_pick(raw, fields), ("total_due",))
    for f in ("period_start", "period_end", "issue_date", "due_date"):
        bill[f] = _date(bill[f])
    items = [_pick(i, ("description", "amount", "date", "item_type")) for i in raw.get("line_items", [])]
    bill["line_items"] = [{**_floats(i, ("amount",)), "date": _date(i["date"])} for i in items]
    bill["status"] = raw.get("status", "Draft")
    return bill


def _customer(raw: Record) -> Record:
    customer = _pick(raw, ("customer_id", "full_name", "date_of_birth", "email", "phone_number"))
    customer["address"] = _pick(raw["address"], ("street", "city", "state", "zip_code"))
    customer["account_status"] = raw.get("account_status", "Pending Verification")
    fields = ("method_type", "account_number_last_4", "expiration_date")
    customer["payment_methods"] = [_pick(m, fields) for m in raw.get("payment_methods", [])]
    customer["line_ids"] = list(raw.get("line_ids", []))
    customer["bill_ids"] = list(raw.get("bill_ids", []))
    customer["created_at"] = _datetime(raw.get("created_at", "2025-01-01 00:00:00"))
    customer["last_extension_date"] = _date(raw.get("last_extension_date"))
    customer["goodwill_credit_used_this_year"] = float(raw.get("goodwill_credit_used_this_year", 0.0))
    return customer


def _line(raw: Record) -> Record:
    fields = ("line_id", "phone_number", "status", "plan_id", "device_id", "data_used_gb", "data_refueling_gb")
    defaults = {"status": "Pending Activation", "data_used_gb": 0.0, "data_refueling_gb": 0.0}
    line = _floats(_pick(raw, fields, defaults), ("data_used_gb", "data_refueling_gb"))
    line["roaming_enabled"] = raw.get("roaming_enabled", False)
    for f in ("contract_end_date", "last_plan_change_date", "last_sim_replacement_date", "suspension_start_date"):
        line[f] = _date(raw.get(f))
    return line


def _device_record(raw: Record) -> Record:
    fields = ("device_id", "device_type", "model", "imei", "is_esim_capable", "activated")
    device = _pick(raw, fields, {"activated": False})
    device["activation_date"] = _datetime(raw.get("activation_date"))
    device["last_esim_transfer_date"] = _datetime(raw.get("last_esim_transfer_date"))
    return device


PHONE_DEFAULTS: Record = {
    "sim_card_status": "active",
    "sim_card_missing": False,
    "airplane_mode": False,
    "network_signal_strength": "good",
    "network_technology_connected": "5G",
    "network_connection_status": "connected",
    "battery_level": 80,
    "data_enabled": True,
    "roaming_enabled": False,
    "network_mode_preference": "4g_5g_preferred",
    "active_apn_settings": None,
    "wifi_enabled": False,
    "wifi_connected": False,
    "wifi_ssid": None,
    "wifi_signal_strength": "none",
    "wifi_calling_enabled": False,
    "wifi_calling_mms_over_wifi": False,
    "data_saver_mode": False,
    "vpn_enabled_setting": False,
    "vpn_connected": False,
    "vpn_details": None,
    "app_statuses": None,
}
DEFAULT_APPS: Record = {
    "messaging": {
        "app_name": "messaging",
        "permissions": {"sms": True, "storage": True, "phone": True, "network": False},
    },
    "browser": {"app_name": "browser", "permissions": {"sms": False, "storage": True, "phone": False, "network": True}},
}
SURROUNDINGS_DEFAULTS: Record = {
    "name": None,
    "phone_number": None,
    "is_abroad": False,
    "roaming_allowed": False,
    "signal_strength": {"2G": "poor", "3G": "fair", "4G": "good", "5G": "excellent"},
    "mobile_data_usage_exceeded": False,
    "line_active": True,
    "payment_request": None,
}


def _phone_record(raw: Record) -> Record:
    phone = _pick(raw, tuple(PHONE_DEFAULTS), PHONE_DEFAULTS)
    phone["active_apn_settings"] = _pick(raw.get("active_apn_settings", {}), tuple(APN_DEFAULTS), APN_DEFAULTS)
    vpn = raw.get("vpn_details")
    phone["vpn_details"] = None if vpn is None else _pick(vpn, tuple(DEFAULT_VPN), {"server_performance": "unknown"})
    apps = raw.get("app_statuses", DEFAULT_APPS)
    phone["app_statuses"] = {
        name: {"app_name": app["app_name"], "permissions": _pick(app.get("permissions", {}), PERMISSIONS, {})}
        for name, app in apps.items()
    }
    for app in phone["app_statuses"].values():
        app["permissions"] = {p: bool(v) for p, v in app["permissions"].items()}
    return phone


def _surroundings_record(raw: Record) -> Record:
    out = _pick(raw, tuple(SURROUNDINGS_DEFAULTS), SURROUNDINGS_DEFAULTS)
    out["signal_strength"] = dict(out["signal_strength"])
    request = out["payment_request"]
    if request is not None:
        out["payment_request"] = {**_floats(_pick(request, ("bill_id", "amount_due")), ("amount_due",))}
        out["payment_request"]["paid"] = request.get("paid", False)
    return out


def normalise(table: str, raw: Record) -> Record:
    """A record of `table` as upstream's model dumps it: every field, in field order, floats where declared."""
    if table == "plans":
        fields = ("plan_id", "name", "data_limit_gb", "price_per_month", "data_refueling_price_per_gb")
        return _floats(_pick(raw, fields), fields[2:])
    if table == "customers":
        return _customer(raw)
    if table == "lines":
        return _line(raw)
    if table == "bills":
        return _bill(raw)
    if table == "devices":
        return _device_record(raw)
    if table == "device":
        return _phone_record(raw)
    return _surroundings_record(raw)


# --- agent side: lookups ---


def _key(db: Tau2DB, table: str, value: Any) -> str:
    """The key of the first record of `table` with this id (a linear scan, as upstream's)."""
    field = ID_FIELD[table]
    for key, record in db[table].items():
        if record[field] == value:
            return key
    raise ValueError(f"{KIND[table]} with ID {value} not found")


def _get(db: Tau2DB, table: str, value: Any) -> Record:
    return db[table][_key(db, table, value)]


def _target_line_key(db: Tau2DB, customer_id: str, line_id: str) -> str:
    """The line of a customer: the customer exists and owns the line, and the line exists."""
    if line_id not in _get(db, "customers", customer_id)["line_ids"]:
        raise ValueError(f"Line {line_id} not found for customer {customer_id}")
    return _key(db, "lines", line_id)


def _bills(db: Tau2DB, customer: Record) -> list[tuple[str, Record]]:
    """The customer's bills as (key, record), in `bill_ids` order."""
    return [(key, db["bills"][key]) for key in (_key(db, "bills", b) for b in customer["bill_ids"])]


# --- agent tools (13) ---


def get_customer_by_phone(db: Tau2DB, phone_number: str) -> Record:
    """The first customer whose contact number, or one of whose lines, is this number."""
    for customer in db["customers"].values():
        if customer["phone_number"] == phone_number:
            return customer
        for line_id in customer["line_ids"]:
            if _get(db, "lines", line_id)["phone_number"] == phone_number:
                return customer
    raise ValueError(f"Customer with phone number {phone_number} not found")


def get_customer_by_id(db: Tau2DB, customer_id: str) -> Record:
    return _get(db, "customers", customer_id)


def get_customer_by_name(db: Tau2DB, full_name: str, dob: str) -> list[Record]:
    """Customers with this name (any case) and exactly this date of birth; possibly none."""
    wanted = full_name.lower()
    return [c for c in db["customers"].values() if c["full_name"].lower() == wanted and c["date_of_birth"] == dob]


def get_details_by_id(db: Tau2DB, id: str) -> Record:
    """A line, device, bill, customer or plan, by the first letter of its id."""
    for prefix, table in PREFIX.items():
        if id.startswith(prefix):
            return _get(db, table, id)
    raise ValueError(f"Unknown ID format or type: {id}")


def get_bills_for_customer(db: Tau2DB, customer_id: str, limit: int = 12) -> list[Record]:
    """The customer's bills, newest issue date first, at most `limit`."""
    bills = [bill for _, bill in _bills(db, _get(db, "customers", customer_id))]
    return sorted(bills, key=lambda bill: bill["issue_date"], reverse=True)[:limit]


def get_data_usage(db: Tau2DB, customer_id: str, line_id: str) -> Record:
    """The line's usage this cycle; numbers come out as strings (SPEC.md §1)."""
    line = db["lines"][_target_line_key(db, customer_id, line_id)]
    plan = _get(db, "plans", line["plan_id"])
    return {
        "line_id": line_id,
        "data_used_gb": str(line["data_used_gb"]),
        "data_limit_gb": str(plan["data_limit_gb"]),
        "data_refueling_gb": str(line["data_refueling_gb"]),
        "cycle_end_date": CYCLE_END,
    }


def suspend_line(db: Tau2DB, customer_id: str, line_id: str, reason: str) -> Record:
    """Suspend an active line from today."""
    key = _target_line_key(db, customer_id, line_id)
    if db["lines"][key]["status"] != "Active":
        raise ValueError("Line must be active to suspend")
    line = db["lines"].edit(key)
    line["status"], line["suspension_start_date"] = "Suspended", TODAY
    return {"message": "Line suspended successfully. $5/month holding fee will apply.", "line": line}


def resume_line(db: Tau2DB, customer_id: str, line_id: str) -> Record:
    """Reactivate a suspended or pending line (no bill or contract check: that is policy)."""
    key = _target_line_key(db, customer_id, line_id)
    if db["lines"][key]["status"] not in ("Suspended", "Pending Activation"):
        raise ValueError("Line must be suspended to resume")
    line = db["lines"].edit(key)
    line["status"], line["suspension_start_date"] = "Active", None
    return {"message": "Line resumed successfully", "line": line}


def send_payment_request(db: Tau2DB, customer_id: str, bill_id: str) -> str:
    """Mark the bill `Awaiting Payment` (even a paid one); the next sync shows it on the phone."""
    customer = _get(db, "customers", customer_id)
    if any(bill["status"] == "Awaiting Payment" for _, bill in _bills(db, customer)):
        raise ValueError("A bill is already awaiting payment for this customer")
    if bill_id not in customer["bill_ids"]:
        raise ValueError(f"Bill {bill_id} not found for customer {customer_id}")
    db["bills"].edit(_key(db, "bills", bill_id))["status"] = "Awaiting Payment"
    return f"Payment request sent to the customer for bill {bill_id}"


def enable_roaming(db: Tau2DB, customer_id: str, line_id: str) -> str:
    """Allow roaming on the line; the phone sees it at the next sync."""
    key = _target_line_key(db, customer_id, line_id)
    if db["lines"][key]["roaming_enabled"]:
        return "Roaming was already enabled"
    db["lines"].edit(key)["roaming_enabled"] = True
    return "Roaming enabled successfully"


def disable_roaming(db: Tau2DB, customer_id: str, line_id: str) -> str:
    """Forbid roaming on the line; the phone sees it at the next sync."""
    key = _target_line_key(db, customer_id, line_id)
    if not db["lines"][key]["roaming_enabled"]:
        return "Roaming was already disabled"
    db["lines"].edit(key)["roaming_enabled"] = False
    return "Roaming disabled successfully"


def _charge(db: Tau2DB, customer_id: str, amount: float, description: str) -> None:
    """Add a line item to the customer's first draft bill (a new one for next month if there is none)."""
    customer = _get(db, "customers", customer_id)
    key = next((k for k, bill in _bills(db, customer) if bill["status"] == "Draft"), None)
    if key is None:  # upstream draws a random id here; never reached by the shipped tasks
        bill_id = f"B{len(db['bills']):08x}"
        start, end, due = NEXT_CYCLE
        new: Record = {"bill_id": bill_id, "customer_id": customer_id, "period_start": start, "period_end": end}
        new.update(issue_date=start, total_due=0.0, due_date=due, line_items=[], status="Draft")
        db.append("bills", new)
        db["customers"].edit(_key(db, "customers", customer_id))["bill_ids"].append(bill_id)
        key = _key(db, "bills", bill_id)
    bill = db["bills"].edit(key)
    item_type = "Credit" if amount < 0 else "Charge"
    bill["line_items"].append(
        {"description": description, "amount": float(amount), "date": TODAY, "item_type": item_type}
    )
    bill["total_due"] += amount


def refuel_data(db: Tau2DB, customer_id: str, line_id: str, gb_amount: float) -> Record:
    """Add data to the line and charge it to the draft bill (the line's status is not checked)."""
    key = _target_line_key(db, customer_id, line_id)
    if gb_amount <= 0:
        raise ValueError("Refuel amount must be positive")
    price = _get(db, "plans", db["lines"][key]["plan_id"])["data_refueling_price_per_gb"]
    charge = gb_amount * price
    line = db["lines"].edit(key)
    line["data_refueling_gb"] += gb_amount
    _charge(db, customer_id, charge, f"Data refueling: {gb_amount} GB at ${price}/GB")
    return {
        "message": f"Successfully added {gb_amount} GB of data for line {line_id} for ${charge:.2f}",
        "new_data_refueling_gb": str(line["data_refueling_gb"]),
        "charge": str(charge),
    }


# --- agent helpers (tasks only) ---


def set_data_usage(db: Tau2DB, customer_id: str, line_id: str, data_used_gb: float) -> str:
    """Setup: the line's data used this cycle, stored as given (int or float)."""
    db["lines"].edit(_target_line_key(db, customer_id, line_id))["data_used_gb"] = data_used_gb
    return f"Data usage set to {data_used_gb} GB for line {line_id}"


def suspend_line_for_overdue_bill(
    db: Tau2DB, customer_id: str, line_id: str, new_bill_id: str, contract_ended: bool
) -> str:
    """Fault injection: an overdue bill of last month's plan price, and the line suspended for it."""
    line_key = _key(db, "lines", line_id)
    line = db["lines"][line_key]
    if line["status"] != "Active":
        raise ValueError("Line must be active to suspend for unpaid bill")
    amount = _get(db, "plans", line["plan_id"])["price_per_month"]
    if amount <= 0:
        raise ValueError("Amount must be positive for overdue bill")
    customer = _get(db, "customers", customer_id)
    if any(bill["status"] == "Overdue" for _, bill in _bills(db, customer)):
        raise ValueError("Customer already has an overdue bill")
    start, end, due = OVERDUE_CYCLE
    item = {"description": f"Charge for line {line_id}", "amount": amount, "date": TODAY, "item_type": "Charge"}
    bill: Record = {"bill_id": new_bill_id, "customer_id": customer_id, "period_start": start, "period_end": end}
    bill.update(issue_date=start, total_due=0.0 + amount, due_date=due, line_items=[item], status="Overdue")
    db.append("bills", bill)
    db["customers"].edit(_key(db, "customers", customer_id))["bill_ids"].append(new_bill_id)
    edited = db["lines"].edit(line_key)
    edited["status"], edited["suspension_start_date"] = "Suspended", TODAY
    if contract_ended:
        edited["contract_end_date"] = end
    return f"Line {line_id} suspended for unpaid bill {new_bill_id}. Contract ended: {contract_ended}"


def assert_data_refueling_amount(db: Tau2DB, customer_id: str, line_id: str, expected_amount: float) -> bool:
    """The line's refuelled data is `expected_amount` (within 1e-6)."""
    line = db["lines"][_target_line_key(db, customer_id, line_id)]
    return bool(abs(line["data_refueling_gb"] - expected_amount) < 1e-6)


def assert_line_status(db: Tau2DB, customer_id: str, line_id: str, expected_status: str) -> bool:
    return bool(db["lines"][_target_line_key(db, customer_id, line_id)]["status"] == expected_status)


def assert_overdue_bill_exists(db: Tau2DB, customer_id: str, overdue_bill_id: str) -> bool:
    """True, or raises: upstream's assertion never returns false."""
    if overdue_bill_id not in _get(db, "customers", customer_id)["bill_ids"]:
        raise ValueError(f"Overdue bill {overdue_bill_id} not found")
    if _get(db, "bills", overdue_bill_id)["status"] != "Overdue":
        raise ValueError(f"Overdue bill {overdue_bill_id} is not overdue")
    return True


def assert_no_overdue_bill(db: Tau2DB, overdue_bill_id: str) -> bool:
    """True if the bill is gone or paid."""
    try:
        return bool(_get(db, "bills", overdue_bill_id)["status"] == "Paid")
    except ValueError:
        return True


# --- environment sync (SPEC.md §7.4) ---


def sync(db: Tau2DB, user_db: Tau2DB) -> None:
    """Mirror the user's line into the surroundings, settle a paid request, and show a bill awaiting payment.

    It never searches the network again: the phone reconnects only when a user tool that searches runs (quirk).
    """
    around = user_db["surroundings"][RECORD]
    phone_number = around["phone_number"]
    if phone_number is None:
        return
    line = next((r for r in db["lines"].values() if r["phone_number"] == phone_number), None)
    if line is None:
        raise ValueError(f"Line with phone number {phone_number} not found")
    plan = _get(db, "plans", line["plan_id"])
    update: Record = {
        "line_active": line["status"] == "Active",
        "roaming_allowed": bool(line["roaming_enabled"]),
        "mobile_data_usage_exceeded": line["data_used_gb"] >= plan["data_limit_gb"] + line["data_refueling_gb"],
    }
    request = around["payment_request"]
    if request is not None and request["paid"]:
        db["bills"].edit(_key(db, "bills", request["bill_id"]))["status"] = "Paid"
        request = update["payment_request"] = None
    if request is None:
        customer = get_customer_by_phone(db, phone_number)
        awaiting = [bill for _, bill in _bills(db, customer) if bill["status"] == "Awaiting Payment"]
        if awaiting:
            bill = awaiting[0]
            update["payment_request"] = {
                "bill_id": bill["bill_id"],
                "amount_due": float(bill["total_due"]),
                "paid": False,
            }
    if any(around[k] != v for k, v in update.items()):
        user_db["surroundings"].edit(RECORD).update(update)


TOOLS: dict[str, ToolFn] = toolkit(
    "TelecomTools",
    (
        get_customer_by_phone, get_customer_by_id, get_customer_by_name, get_details_by_id, suspend_line,
        resume_line, get_bills_for_customer, send_payment_request, get_data_usage, enable_roaming, disable_roaming,
        transfer_to_human_agents, refuel_data,
    ),
)  # fmt: skip
WRITE_TOOLS = frozenset(
    {"suspend_line", "resume_line", "send_payment_request", "enable_roaming", "disable_roaming", "refuel_data"}
)
HELPERS: dict[str, ToolFn] = toolkit(
    "TelecomTools",
    (
        set_data_usage, suspend_line_for_overdue_bill, assert_data_refueling_amount, assert_line_status,
        assert_overdue_bill_exists, assert_no_overdue_bill,
    ),
)  # fmt: skip

__all__ = ["HELPERS", "TOOLS", "USER_HELPERS", "USER_TOOLS", "USER_WRITE_TOOLS", "WRITE_TOOLS", "sync"]
