"""tau2's mock domain (SPEC.md §3.5): a task list for testing the framework; agent and user toolkits."""

from gyms.tau.store import Record
from gyms.tau2.store import Tau2DB
from gyms.tau2.toolkit import ToolFn, toolkit, transfer_to_human_agents

TABLES = ("tasks", "users")
USER_TABLES = ("notifications",)
TASK_STATUSES = ("pending", "completed")


def normalise(table: str, raw: Record) -> Record:
    """A record of `table` as upstream's model dumps it."""
    if table == "tasks":
        return {
            "task_id": raw["task_id"],
            "title": raw["title"],
            "description": raw.get("description"),
            "status": raw["status"],
        }
    if table == "users":
        return {"user_id": raw["user_id"], "name": raw["name"], "tasks": list(raw["tasks"])}
    fields = ("notification_id", "message")
    return {**{f: raw[f] for f in fields}, "status": raw.get("status", "unread"), "task_id": raw.get("task_id")}


def create_task(db: Tau2DB, user_id: str, title: str, description: str | None = None) -> Record:
    if user_id not in db["users"]:
        raise ValueError(f"User {user_id} not found")
    task_id = f"task_{len(db['tasks']) + 1}"
    task = {"task_id": task_id, "title": title, "description": description, "status": "pending"}
    db["tasks"].insert(task_id, task)
    db["users"].edit(user_id)["tasks"].append(task_id)
    return task


def get_users(db: Tau2DB) -> list[Record]:
    return list(db["users"].values())


def update_task_status(db: Tau2DB, task_id: str, status: str) -> Record:
    if task_id not in db["tasks"]:
        raise ValueError(f"Task {task_id} not found")
    task = db["tasks"].edit(task_id)
    task["status"] = status
    return task


def assert_number_of_tasks(db: Tau2DB, user_id: str, expected_number: int) -> bool:
    if user_id not in db["users"]:
        raise ValueError(f"User {user_id} not found")
    return len(db["users"][user_id]["tasks"]) == expected_number


def assert_task_status(db: Tau2DB, task_id: str, expected_status: str) -> bool:
    if task_id not in db["tasks"]:
        raise ValueError(f"Task {task_id} not found")
    return bool(db["tasks"][task_id]["status"] == expected_status)


def check_notifications(db: Tau2DB) -> list[Record]:
    return list(db["notifications"].values())


def dismiss_notification(db: Tau2DB, notification_id: str) -> str:
    if notification_id not in db["notifications"]:
        raise ValueError(f"Notification {notification_id} not found")
    db["notifications"].edit(notification_id)["status"] = "read"
    return f"Notification {notification_id} dismissed"


def add_notification(db: Tau2DB, notification_id: str, message: str, task_id: str | None = None) -> Record:
    record = {"notification_id": notification_id, "message": message, "status": "unread", "task_id": task_id}
    db["notifications"].insert(notification_id, record)
    return record


def assert_notification_status(db: Tau2DB, notification_id: str, expected_status: str) -> bool:
    if notification_id not in db["notifications"]:
        raise ValueError(f"Notification {notification_id} not found")
    return bool(db["notifications"][notification_id]["status"] == expected_status)


TOOLS: dict[str, ToolFn] = toolkit("MockTools", (create_task, get_users, update_task_status, transfer_to_human_agents))
WRITE_TOOLS = frozenset({"create_task", "update_task_status"})
HELPERS: dict[str, ToolFn] = toolkit("MockTools", (assert_number_of_tasks, assert_task_status))
USER_TOOLS: dict[str, ToolFn] = toolkit("MockUserTools", (check_notifications, dismiss_notification))
USER_WRITE_TOOLS = frozenset({"dismiss_notification"})
USER_HELPERS: dict[str, ToolFn] = toolkit("MockUserTools", (add_notification, assert_notification_status))
