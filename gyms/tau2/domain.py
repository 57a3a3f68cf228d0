"""A tau2 domain: its shared base databases, toolkits, policy, tasks, splits, initial states and reward.

`load_domain(name, folder)` loads a domain once per process; every episode takes a fresh `Env` (copy-on-write
databases over the shared base). The reward is tau2's (SPEC.md §9.2): the product of the components the task's
`reward_basis` names, among DB (agent and user hashes equal the gold replay's), ENV_ASSERTION, ACTION and
COMMUNICATE. NL_ASSERTION needs an LLM judge and is not scored here: a basis naming it reports it in
`Score.unscored` and the reward covers the other components only.

A domain module may declare, besides its tools and tables: `DB_FILE`/`USER_DB_FILE` (JSON or TOML), `SHAPES` (the
tables that are lists or single records, gyms.tau2.store), `policy(folder)` (the policy text) and `sync(db,
user_db)`, run after every executed tool call and helper call and after setup, as upstream's `sync_tools`.
"""

import copy
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from gyms.data import data_dir
from gyms.tau2 import airline, mock, retail, telecom
from gyms.tau2.store import RECORD, JsonBaseTables, Shape, Tau2DB, position
from gyms.tau2.toolkit import Observation, ToolFn, invoke

DOMAINS = ("mock", "airline", "retail", "telecom")
_MODULES: dict[str, ModuleType] = {"mock": mock, "airline": airline, "retail": retail, "telecom": telecom}
DEFAULT_BASIS = ("DB", "COMMUNICATE")
SCORED = ("DB", "ENV_ASSERTION", "ACTION", "COMMUNICATE")


def _merge(base: Any, patch: Any) -> Any:
    """upstream's deep merge of initialization data: dicts merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(patch)


@dataclass
class Env:
    """One episode's environment: the agent database and, in dual-control domains, the user's."""

    domain: "Domain"
    db: Tau2DB
    user_db: Tau2DB | None

    def call(
        self, name: str, arguments: dict[str, Any], requestor: str = "assistant", *, sync: bool = True
    ) -> Observation:
        """Run one tool call of the agent (or, with `requestor="user"`, of the user); never raises.

        A call that succeeds is followed by the domain's sync, as upstream's `get_response`; `sync=False` is
        upstream's `make_tool_call`, which its evaluator uses to build the gold databases.
        """
        after = self.sync if sync else None
        if requestor == "user":
            if self.user_db is None:
                return Observation(f"Error: Tool '{name}' not found.", True)
            return invoke(self.domain.user_tools, self.user_db, name, arguments, after)
        return invoke(self.domain.tools, self.db, name, arguments, after)

    def helper(self, env_type: str, name: str, arguments: dict[str, Any]) -> Any:
        """Call a non-tool toolkit function (initialisation, assertion), then sync; raises as upstream does."""
        user = env_type == "user"
        table = self.domain.user_helpers if user else self.domain.helpers
        tools = self.domain.user_tools if user else self.domain.tools
        fn = table.get(name) or tools.get(name)
        if fn is None:
            raise ValueError(f"{self.domain.name}: no function {name!r} for {env_type}")
        result = fn(self.user_db if user else self.db, **arguments)
        self.sync()
        return result

    def sync(self) -> None:
        """The domain's environment sync (telecom: the phone's surroundings follow the agent's records)."""
        if self.domain.sync is not None and self.user_db is not None:
            self.domain.sync(self.db, self.user_db)

    def hashes(self) -> tuple[str, str | None]:
        return self.db.hash(), None if self.user_db is None else self.user_db.hash()


@dataclass
class Score:
    """An episode's reward and its components."""

    reward: float
    components: dict[str, float]
    unscored: list[str] = field(default_factory=list)
    db_hash: str = ""
    gold_hash: str = ""

    def info(self) -> dict[str, Any]:
        return {
            "components": dict(self.components),
            "unscored": list(self.unscored),
            "db_hash": self.db_hash,
            "gold_db_hash": self.gold_hash,
        }


class Domain:
    """Everything about one domain that episodes share; built once per process by `load_domain`."""

    def __init__(self, name: str, folder: Path) -> None:
        if name not in DOMAINS:
            raise ValueError(f"unknown tau2 domain {name!r}; expected one of {', '.join(DOMAINS)}")
        if not folder.is_dir():
            raise FileNotFoundError(f"tau2 data not found at {folder} (set gyms.data_dir to the folder holding tau2/)")
        module = _MODULES[name]
        self.name, self.folder, self.module = name, folder, module
        self.tools: dict[str, ToolFn] = module.TOOLS
        self.write_tools: frozenset[str] = module.WRITE_TOOLS
        self.helpers: dict[str, ToolFn] = getattr(module, "HELPERS", {})
        self.user_tools: dict[str, ToolFn] = getattr(module, "USER_TOOLS", {})
        self.user_write_tools: frozenset[str] = getattr(module, "USER_WRITE_TOOLS", frozenset())
        self.user_helpers: dict[str, ToolFn] = getattr(module, "USER_HELPERS", {})
        self.sync: Callable[[Tau2DB, Tau2DB], None] | None = getattr(module, "sync", None)
        self.shapes: dict[str, Shape] = getattr(module, "SHAPES", {})
        self.base = self._load(getattr(module, "DB_FILE", "db.json"), module.TABLES)
        user_tables: tuple[str, ...] = getattr(module, "USER_TABLES", ())
        user_file = getattr(module, "USER_DB_FILE", "user_db.json")
        self.user_base = self._load(user_file, user_tables) if user_tables else None
        self.schemas: list[dict[str, Any]] = json.loads((folder / "tools.json").read_text(encoding="utf-8"))
        user_schemas = folder / "user_tools.json"
        self.user_schemas: list[dict[str, Any]] = (
            json.loads(user_schemas.read_text(encoding="utf-8")) if user_schemas.is_file() else []
        )
        policy: Callable[[Path], str] | None = getattr(module, "policy", None)
        self.policy = policy(folder) if policy else (folder / "policy.md").read_text(encoding="utf-8")
        solo: Callable[[Path], str] | None = getattr(module, "solo_policy", None)
        solo_file = folder / "policy_solo.md"
        # The solo policy (gyms.tau2.solo); "" for a domain without solo mode (airline, retail).
        self.solo_policy = (
            solo(folder) if solo else solo_file.read_text(encoding="utf-8") if solo_file.is_file() else ""
        )
        self.tasks: dict[str, dict[str, Any]] = {
            t["id"]: t for t in json.loads((folder / "tasks.json").read_text(encoding="utf-8"))
        }
        self.splits: dict[str, list[str]] = json.loads((folder / "split_tasks.json").read_text(encoding="utf-8"))
        self._gold: dict[str, tuple[str, str | None]] = {}
        for file, schemas, tools in (
            ("tools.json", self.schemas, self.tools),
            ("user_tools.json", self.user_schemas, self.user_tools),
        ):
            differ = {s["function"]["name"] for s in schemas} ^ set(tools)
            if differ and schemas:
                raise ValueError(f"{name}: {file} and the implemented tools differ: {sorted(differ)}")

    def _load(self, file: str, tables: tuple[str, ...]) -> JsonBaseTables:
        text = (self.folder / file).read_text(encoding="utf-8")
        raw = tomllib.loads(text) if file.endswith(".toml") else json.loads(text)
        loaded: dict[str, dict[str, Any]] = {}
        for t in tables:
            shape = self.shapes.get(t, "object")
            if shape == "list":
                loaded[t] = {position(i): self.module.normalise(t, r) for i, r in enumerate(raw.get(t, []))}
            elif shape == "record":
                loaded[t] = {RECORD: self.module.normalise(t, raw.get(t, {}))}
            else:
                loaded[t] = {k: self.module.normalise(t, r) for k, r in raw[t].items()}
        return JsonBaseTables(loaded, self.shapes)

    def task(self, task_id: str) -> dict[str, Any]:
        if task_id not in self.tasks:
            raise ValueError(f"tau2 {self.name} has no task {task_id!r}")
        return self.tasks[task_id]

    def task_user_schemas(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user tools' schemas of a task: the domain's, restricted to the task's `user_tools` if it lists them
        (upstream's `get_user_tools(include=task.user_tools)`)."""
        allowed = task.get("user_tools")
        return [s for s in self.user_schemas if allowed is None or s["function"]["name"] in allowed]

    def split(self, split: str) -> list[str]:
        """Task ids of a split (`train`, `test`, `base`, ...; `all` = every task in file order)."""
        if split == "all":
            return list(self.tasks)
        if split not in self.splits:
            raise ValueError(f"tau2 {self.name} has no split {split!r}; splits: all, {', '.join(self.splits)}")
        return list(self.splits[split])

    def new_env(self, task: dict[str, Any] | None = None) -> Env:
        """A fresh environment, with the task's initial state applied (SPEC.md §8, `set_state`)."""
        env = Env(self, Tau2DB(self.base), None if self.user_base is None else Tau2DB(self.user_base))
        env.sync()
        state = (task or {}).get("initial_state") or {}
        data = state.get("initialization_data") or {}
        for db, patch in ((env.db, data.get("agent_data")), (env.user_db, data.get("user_data"))):
            if patch and db is not None:
                for table, records in patch.items():
                    self._patch(db, table, records)
        for action in state.get("initialization_actions") or []:
            env.helper(action.get("env_type", "assistant"), action["func_name"], action.get("arguments", {}))
        self.replay_messages(env, state.get("message_history") or [])
        env.sync()
        return env

    def _patch(self, db: Tau2DB, table: str, patch: Any) -> None:
        """Merge a table's initialization data into an episode's database (upstream's deep merge)."""
        shape = self.shapes.get(table, "object")
        if shape == "record":
            db[table].insert(RECORD, self.module.normalise(table, _merge(db[table][RECORD], patch)))
        elif shape == "list":
            raise ValueError(f"{self.name}: initialization data for list table {table!r} is not supported")
        else:
            for key, record in patch.items():
                merged = _merge(db[table][key], record) if key in db[table] else record
                db[table].insert(key, self.module.normalise(table, merged))

    def replay_messages(self, env: Env, messages: list[dict[str, Any]]) -> None:
        """Re-execute the mutating tool calls of a message history (unknown and read-only calls skipped)."""
        for message in messages:
            requestor = "user" if message.get("role") == "user" else "assistant"
            writes = self.user_write_tools if requestor == "user" else self.write_tools
            for call in message.get("tool_calls") or []:
                if call["name"] in writes:
                    env.call(call["name"], call.get("arguments", {}), requestor)

    def gold_hashes(self, task: dict[str, Any]) -> tuple[str, str | None]:
        """Hashes after the task's gold actions (upstream's target: errors ignored, no sync); cached per process."""
        if task["id"] not in self._gold:
            env = self.new_env(task)
            for action in (task.get("evaluation_criteria") or {}).get("actions") or []:
                requestor = action.get("requestor", "assistant")
                env.call(action["name"], action.get("arguments", {}), requestor, sync=False)
            self._gold[task["id"]] = env.hashes()
        return self._gold[task["id"]]

    def score(self, task: dict[str, Any], env: Env, calls: list[tuple[str, dict[str, Any]]], said: list[str]) -> Score:
        """tau2's reward of an episode that ended normally: `env` as left, the tool calls made, the agent's texts."""
        criteria = task.get("evaluation_criteria") or {}
        basis = list(criteria.get("reward_basis") or DEFAULT_BASIS)
        gold = self.gold_hashes(task)
        hashes = env.hashes()
        if not criteria.get("actions") and not criteria.get("env_assertions"):
            db_ok = True
        else:
            db_ok = hashes == gold
        components = {"DB": float(db_ok)}
        met = [
            env.helper(a.get("env_type", "assistant"), a["func_name"], a.get("arguments", {}))
            == a.get("assert_value", True)
            for a in criteria.get("env_assertions") or []
        ]
        components["ENV_ASSERTION"] = float(all(met))
        components["ACTION"] = float(all(_action_matched(a, calls) for a in criteria.get("actions") or []))
        texts = [s.lower().replace(",", "") for s in said]
        components["COMMUNICATE"] = float(
            all(any(i.lower() in t for t in texts) for i in criteria.get("communicate_info") or [])
        )
        unscored = [b for b in basis if b not in SCORED]
        reward = 1.0
        for b in basis:
            reward *= components.get(b, 1.0)
        return Score(reward, {b: components[b] for b in basis if b in components}, unscored, hashes[0], gold[0])


def _action_matched(action: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """[quirk] compares `compare_args` if given, else the keys of the trajectory's call."""
    keys = action.get("compare_args")
    gold = action.get("arguments") or {}
    for name, arguments in calls:
        if name != action["name"]:
            continue
        compared = arguments.keys() if keys is None else keys
        if all(arguments.get(k) == gold.get(k) for k in compared):
            return True
    return False


def tau2_dir(configured: str = "") -> Path:
    """The tau2/ folder of the data folder."""
    return data_dir(configured) / "tau2"


@cache
def load_domain(name: str, root: str) -> Domain:
    """The process-wide `Domain` for `<root>/<name>` (`root`: a tau2/ folder; loaded on first use)."""
    return Domain(name, Path(root) / name)
