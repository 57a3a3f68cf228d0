"""Task ids, task records and the Task rows of the three tau gyms.

A task id names a tau-bench task the way UserRL's TauGym does: `retail-007` and `airline-012` are test tasks,
`retail-train-007` a train task (the number is the index in tau-bench's task list). Every task used here has a
recorded opening line (UserRL's `tau_{train,test}.json`): the policy's first user message, and where the
simulated customer's history starts. A task record (`Task.metadata["record"]`) holds what a gym needs:
`{id, domain, split, index, opening, data_dir}`.

- `tau` (UserRL TauGym): UserRL's prompt rows (`userrl/data/tau_multiturn`), one `interact_with_env` tool;
  train = 500 retail-train tasks, test = 115 retail + 50 airline tasks.
- `tau_retail` / `tau_airline` (MUA-RL style): the domain policy as system prompt, the opening line as user
  message, the domain tools as native function tools; a reply without a tool call is a message to the customer.
"""

import re
from functools import cache
from pathlib import Path
from typing import Any

from gyms.data import FETCH_HINT, DataMissingError, check_split, data_dir, read_json, require, userrl_rows, userrl_task
from userrl_megatron.types import Message, Task

OPENINGS = "userrl/gyms/TauGym/taugym/data/tau_{split}.json"
DOMAIN_GYMS = {"tau_retail": "retail", "tau_airline": "airline"}
DOMAIN_SPLITS = {"retail": ("train", "test"), "airline": ("test",)}
_TASK_ID = re.compile(r"^(retail|airline)(?:-(train|test))?-(\d+)$")


def parse_task_id(task_id: str) -> tuple[str, str, int]:
    """`retail-train-007` -> ("retail", "train", 7); `airline-012` -> ("airline", "test", 12)."""
    match = _TASK_ID.match(task_id.strip().lower())
    if match is None:
        raise ValueError(
            f"not a tau task id: {task_id!r} (expected e.g. 'retail-007', 'retail-train-007' or 'airline-012')"
        )
    domain, split, index = match.group(1), match.group(2) or "test", int(match.group(3))
    if split not in DOMAIN_SPLITS[domain]:
        raise ValueError(f"tau task {task_id!r}: {domain} has no {split} split")
    return domain, split, index


def format_task_id(domain: str, split: str, index: int) -> str:
    """The canonical id: the split is spelled out except for test (UserRL's ids)."""
    return f"{domain}-{index:03d}" if split == "test" else f"{domain}-{split}-{index:03d}"


@cache
def openings(root: Path, split: str) -> dict[str, str]:
    """Recorded opening line of every task of a split, by task id."""
    return {row["id"]: row["obs"].strip() for row in read_json(root, OPENINGS.format(split=split))}


def record_for(task_id: str, root: Path) -> dict[str, Any]:
    """The record of a task id, read from the data folder `root`."""
    domain, split, index = parse_task_id(task_id)
    canonical = format_task_id(domain, split, index)
    opening = openings(root, split).get(canonical)
    if opening is None:
        raise ValueError(f"tau task {canonical!r} has no recorded opening line in {OPENINGS.format(split=split)}")
    return {
        "id": canonical,
        "domain": domain,
        "split": split,
        "index": index,
        "opening": opening,
        "data_dir": str(root),
    }


def taubench_dir(record: dict[str, Any], configured: str) -> Path:
    """The taubench/ folder an episode reads: the configured data folder, else the task's, else the default."""
    for candidate in (configured, record.get("data_dir", "")):
        if candidate and (Path(candidate).expanduser() / "taubench").is_dir():
            return (Path(candidate).expanduser() / "taubench").resolve()
    root = data_dir(configured)
    if not (root / "taubench").is_dir():
        raise DataMissingError(f"taubench/ is missing from the data folder {root}: {FETCH_HINT}")
    return (root / "taubench").resolve()


def tau_tasks(split: str, root: Path) -> list[Task]:
    """Gym `tau`: UserRL's TauGym rows of `split`, each with its task record."""
    check_split("tau", split)
    return [
        userrl_task("tau", row, row["reward_model"]["id"], record_for(row["reward_model"]["id"], root))
        for row in userrl_rows(root, "tau_multiturn", split)
    ]


def domain_tasks(gym: str, split: str, root: Path) -> list[Task]:
    """Gym `tau_retail` / `tau_airline`: every task of the split with a recorded opening, in index order."""
    domain = DOMAIN_GYMS[gym]
    check_split(gym, split, DOMAIN_SPLITS[domain])
    policy = require(root, f"taubench/{domain}/policy.md").read_text(encoding="utf-8")
    tools = read_json(root, f"taubench/{domain}/tools.json")
    records = [record_for(task_id, root) for task_id in openings(root, split) if task_id.startswith(domain + "-")]
    return [
        Task(
            gym=gym,
            task_id=record["id"],
            prompt=[Message("system", policy), Message("user", record["opening"])],
            tools=list(tools),
            metadata={"record": record, "data_source": f"taubench_{domain}", "reply_without_tool_call": "action"},
        )
        for record in sorted(records, key=lambda r: r["index"])
    ]
