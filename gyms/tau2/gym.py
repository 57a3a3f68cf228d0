"""Gym `tau2_mock`: tau2's mock domain in solo mode (SPEC.md §10), no user simulator.

The agent gets the solo policy and the task's ticket, calls the domain tools as `[answer] {"name": ...,
"arguments": {...}}` (or natively, through the rollout's tool bridge), and ends with the `done` tool; a plain
message ends the episode as an agent error (reward 0), as upstream's solo mode does. The final step carries tau2's
reward (gyms.tau2.domain.Domain.score). The airline and retail gyms, which need the user simulator, come later.
"""

import json
import logging
from pathlib import Path
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.data import data_dir
from gyms.smoke import SmokeEpisode
from gyms.tau.gym import parse_tool_call
from gyms.tau2.domain import Domain, load_domain
from gyms.tau2.settings import Tau2GymConfig
from gyms.turn_gym import TurnGym
from userrl_megatron.types import Message, Task

log = logging.getLogger(__name__)

DONE_TOOL = "done"
DONE_SCHEMA = {
    "type": "function",
    "function": {
        "name": DONE_TOOL,
        "description": "Call this function when you are done with the task.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


def tau2_dir(configured: str = "") -> Path:
    """The tau2/ folder of the data folder."""
    return data_dir(configured) / "tau2"


class Tau2SoloGym(TurnGym):
    """One tau2 task in solo mode."""

    name = "tau2_mock"
    domain_name = "mock"

    def __init__(self, task: Any, config: Tau2GymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or Tau2GymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, lambda task_id: {"id": task_id})
        root = self.record.get("tau2_dir") or str(tau2_dir(self.config.data_dir))
        self.domain: Domain = load_domain(self.domain_name, root)
        self.task = self.domain.task(self.record["id"])
        self.start()

    def start(self) -> None:
        self.env = self.domain.new_env(self.task)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def observation(self) -> str:
        return str(self.task.get("ticket") or "")

    async def act(self, tag: str | None, payload: str) -> StepResult:
        call = parse_tool_call(payload) if tag == "answer" else None
        if call is None:  # solo mode: a message that is not a tool call is an agent error
            return StepResult("Solo mode: only tool calls are allowed.", 0.0, done=True, info={"error": "agent_error"})
        name, arguments = call
        if name == DONE_TOOL:
            try:
                score = self.domain.score(self.task, self.env, self.calls, [])
            except RecursionError:  # a tool stored a value nested too deep to hash; it cannot be the gold database
                info = {"error": "the database holds a value nested too deeply to hash"}
                return StepResult("Done.", 0.0, done=True, info={"reward_info": info})
            return StepResult("Done.", score.reward, done=True, info={"reward_info": score.info()})
        self.calls.append((name, arguments))
        out = self.env.call(name, arguments)
        return StepResult(out.content, 0.0, info={"tool": name, "tool_error": out.error})


def mock_tasks(split: str, root: Path) -> list[Task]:
    """Gym `tau2_mock`: the tasks of a split of mock's `split_tasks.json`, solo prompts."""
    domain = load_domain("mock", str(root / "tau2"))
    policy = (domain.folder / "policy_solo.md").read_text(encoding="utf-8")
    tools = [*domain.schemas, DONE_SCHEMA]
    tasks = []
    for task_id in domain.split(split):
        record = {"id": task_id, "tau2_dir": str(root / "tau2")}
        ticket = str(domain.task(task_id).get("ticket") or "")
        prompt = [Message("system", policy), Message("user", ticket)]
        tasks.append(Task("tau2_mock", task_id, prompt, list(tools), {"record": record, "data_source": "tau2_mock"}))
    return tasks


def mock_smoke() -> list[SmokeEpisode]:
    """tau2_mock: a task's gold calls then `done` earn 1; a wrong call then `done` earns 0. They need the tau2 data."""
    root = tau2_dir()
    if not (root / "mock").is_dir():
        log.warning("tau2 smoke episodes skipped: no tau2 data in %s", root)
        return []
    task = load_domain("mock", str(root)).task("create_task_1")
    gold = [
        "[answer] " + json.dumps({"name": a["name"], "arguments": a.get("arguments", {})})
        for a in task["evaluation_criteria"]["actions"]
    ]
    done = "[answer] " + json.dumps({"name": DONE_TOOL, "arguments": {}})
    wrong = "[answer] " + json.dumps({"name": "update_task_status", "arguments": {"task_id": "nope", "status": "x"}})
    return [
        SmokeEpisode("gold calls, then done", "create_task_1", [*gold, done], [0.0] * len(gold) + [1.0]),
        SmokeEpisode("a failed call, then done", "create_task_1", [wrong, done], [0.0, 0.0]),
    ]


register_gym("tau2_mock", config_type=Tau2GymConfig, config_field="tau2", tasks=mock_tasks, smoke=mock_smoke)(
    Tau2SoloGym
)
