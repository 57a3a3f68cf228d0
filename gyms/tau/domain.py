"""A tau-bench domain (retail or airline): its shared base database, tools, policy, tasks and reward.

`load_domain(name, taubench_dir)` loads a domain once per process; every episode then takes a fresh
`EpisodeDB` from it (`Domain.new_db`). The reward is tau-bench's (SPEC.md §5.2): 1.0 iff the final database
hashes like the database after the task's gold actions, and every required output was said to the user.
"""

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from gyms.tau import airline, retail
from gyms.tau.store import BaseTables, EpisodeDB
from gyms.tau.toolkit import TERMINATE_TOOL, ToolFn, invoke

DOMAINS = ("retail", "airline")
SPLITS = {"retail": ("train", "test", "dev", "legacy"), "airline": ("test",)}
_MODULES = {"retail": retail, "airline": airline}


@dataclass(frozen=True)
class TauTask:
    """One tau-bench task: the customer's instruction, the gold tool calls and the outputs to be said."""

    domain: str
    split: str
    index: int
    user_id: str
    instruction: str
    actions: tuple[dict[str, Any], ...]  # gold calls: {"name": tool, "kwargs": {...}}
    outputs: tuple[str, ...]  # strings some agent message must contain


@dataclass
class Score:
    """The reward of an episode and why."""

    reward: float
    db_hash: str
    gold_hash: str
    outputs: dict[str, bool]  # required output -> found in some agent message

    @property
    def db_match(self) -> bool:
        return self.db_hash == self.gold_hash

    def info(self) -> dict[str, Any]:
        """tau-bench's reward info: r_actions, the gold hash and, when outputs exist, r_outputs and the map."""
        out: dict[str, Any] = {"r_actions": float(self.db_match), "gt_data_hash": self.gold_hash}
        if self.outputs:
            out["r_outputs"] = float(all(self.outputs.values()))
            out["outputs"] = dict(self.outputs)
        return out


class Domain:
    """Everything about one domain that episodes share; built once per process by `load_domain`."""

    def __init__(self, name: str, folder: Path) -> None:
        if name not in DOMAINS:
            raise ValueError(f"unknown tau domain {name!r}; expected one of {', '.join(DOMAINS)}")
        if not folder.is_dir():
            raise FileNotFoundError(
                f"tau-bench data not found at {folder} (run `userrl data fetch`, or set gyms.data_dir)"
            )
        module = _MODULES[name]
        self.name = name
        self.folder = folder
        self.tools: dict[str, ToolFn] = module.TOOLS
        self.base = BaseTables.from_json_files(folder, module.TABLES)
        self.schemas: list[dict[str, Any]] = json.loads((folder / "tools.json").read_text(encoding="utf-8"))
        self.policy = (folder / "policy.md").read_text(encoding="utf-8")
        self._tasks: dict[str, list[TauTask]] = {}
        self._gold: dict[tuple[str, int], str] = {}
        missing = {s["function"]["name"] for s in self.schemas} ^ set(self.tools)
        if missing:
            raise ValueError(f"{name}: tools.json and the implemented tools differ: {sorted(missing)}")

    def new_db(self) -> EpisodeDB:
        """A fresh database for one episode (copy-on-write over the shared base)."""
        return EpisodeDB(self.base)

    def call(self, db: EpisodeDB, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call; the observation string (errors included, never raises)."""
        return invoke(self.tools, db, name, arguments)

    @staticmethod
    def is_terminal(name: str) -> bool:
        """Whether calling this tool ends the episode."""
        return name == TERMINATE_TOOL

    def tasks(self, split: str) -> list[TauTask]:
        """The tasks of one split, in file order (the index is the position)."""
        if split not in SPLITS[self.name]:
            raise ValueError(f"{self.name} has no split {split!r}; splits: {', '.join(SPLITS[self.name])}")
        if split not in self._tasks:
            rows = json.loads((self.folder / f"tasks_{split}.json").read_text(encoding="utf-8"))
            self._tasks[split] = [
                TauTask(
                    domain=self.name,
                    split=split,
                    index=i,
                    user_id=row["user_id"],
                    instruction=row["instruction"],
                    actions=tuple(row["actions"]),
                    outputs=tuple(row["outputs"]),
                )
                for i, row in enumerate(rows)
            ]
        return self._tasks[split]

    def task(self, split: str, index: int) -> TauTask:
        tasks = self.tasks(split)
        if not 0 <= index < len(tasks):
            raise ValueError(f"{self.name} {split} has {len(tasks)} tasks; index {index} is out of range")
        return tasks[index]

    def replay(self, actions: tuple[dict[str, Any], ...] | list[dict[str, Any]], db: EpisodeDB) -> list[str | None]:
        """Apply gold actions in order (terminate tools skipped, as tau-bench's reward does): observations."""
        return [None if self.is_terminal(a["name"]) else self.call(db, a["name"], a["kwargs"]) for a in actions]

    def gold_hash(self, task: TauTask) -> str:
        """Hash of the database after the task's gold actions (replayed once per process, then cached)."""
        key = (task.split, task.index)
        if key not in self._gold:
            db = self.new_db()
            self.replay(task.actions, db)
            self._gold[key] = db.hash()
        return self._gold[key]

    def score(self, task: TauTask, db: EpisodeDB, messages: list[str]) -> Score:
        """tau-bench's reward for an episode that left `db` and told the user `messages`."""
        found = {o: any(o.lower() in m.lower().replace(",", "") for m in messages) for o in task.outputs}
        h, gold = db.hash(), self.gold_hash(task)
        reward = 1.0 if h == gold and all(found.values()) else 0.0
        return Score(reward=reward, db_hash=h, gold_hash=gold, outputs=found)


@cache
def load_domain(name: str, taubench_dir: str) -> Domain:
    """The process-wide `Domain` for `<taubench_dir>/<name>` (loaded on first use)."""
    return Domain(name, Path(taubench_dir) / name)
