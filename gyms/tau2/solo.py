"""tau2's solo mode (SPEC.md §10): `tau2_mock` and `tau2_telecom_solo`, no simulated user.

The agent gets the solo instructions, the domain's solo policy and the task's ticket, and both tool sets: the
agent's tools, the user's (restricted to the task's `user_tools` when it lists them) and a `done` tool. A call to a
user tool runs on the user's side (upstream's `make_tool_call` in solo mode routes it there by name). Calls are
`[answer] {"name": ..., "arguments": {...}}` or native, through the rollout's tool bridge. `done` ends the episode
and scores it (`agent_stop`). A plain message ends it as an agent error (reward 0), as upstream's solo agent does.
`max_errors` failed calls end it as `too_many_errors`, the step limit as `max_steps`; neither is scored.

Only the tasks upstream's solo agent accepts are offered (`solo_ready`): a task with an initial state whose
message history holds no user message and no assistant text, or else a task with a ticket and gold actions.
"""

import functools
import json
import logging
from pathlib import Path
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.data import NoSuchSplitError
from gyms.smoke import SmokeEpisode
from gyms.tau.gym import parse_tool_call
from gyms.tau2.domain import Domain, load_domain, tau2_dir
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
SOLO_INSTRUCTIONS = (
    "You are a customer service agent. Solve the ticket below by following the policy.\n"
    "You cannot talk to the customer: plan, then make tool calls, one at a time.\n"
    f"When the ticket is solved, call the `{DONE_TOOL}` tool, and nothing else in that turn."
)
MESSAGE_IN_SOLO = "Solo mode: only tool calls are allowed."


def solo_system(policy: str) -> str:
    """The solo system prompt: the instructions, then the domain's solo policy in `<policy>`."""
    return f"{SOLO_INSTRUCTIONS}\n\n<policy>\n{policy}\n</policy>"


def solo_ready(task: dict[str, Any]) -> bool:
    """Whether upstream's solo agent accepts the task (`LLMSoloAgent.check_valid_task`)."""
    state = task.get("initial_state")
    if state is not None:
        for message in state.get("message_history") or []:
            if message.get("role") == "user" or (message.get("role") == "assistant" and not message.get("tool_calls")):
                return False
        return True
    actions = (task.get("evaluation_criteria") or {}).get("actions")
    return task.get("ticket") is not None and bool(actions)


def solo_tools(domain: Domain, task: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas a solo agent is given: the agent's tools, the task's user tools, `done`."""
    return [*domain.schemas, *domain.task_user_schemas(task), DONE_SCHEMA]


class Tau2SoloGym(TurnGym):
    """One tau2 task in solo mode (see the module docstring)."""

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
        self.calls: list[tuple[str, dict[str, Any]]] = []  # every call, failed ones too (ACTION)
        self.errors = 0  # tool results with an error

    def observation(self) -> str:
        return str(self.task.get("ticket") or "")

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if result.truncated and not result.done:
            result.info["termination_reason"] = "max_steps"
        return result

    async def act(self, tag: str | None, payload: str) -> StepResult:
        call = parse_tool_call(payload) if tag == "answer" else None
        if call is None:
            ended = {"error": "agent_error", "termination_reason": "agent_error"}
            return StepResult(MESSAGE_IN_SOLO, 0.0, done=True, info=ended)
        name, arguments = call
        if name == DONE_TOOL:
            return self._finish()
        self.calls.append((name, arguments))
        requestor = "user" if name in self.domain.user_tools else "assistant"
        out = self.env.call(name, arguments, requestor)
        self.errors += out.error
        info: dict[str, Any] = {"tool": name, "tool_error": out.error}
        if requestor == "user":
            info["requestor"] = "user"
        if self.errors >= self.config.max_errors:
            return StepResult(out.content, 0.0, done=True, info={**info, "termination_reason": "too_many_errors"})
        return StepResult(out.content, 0.0, info=info)

    def _finish(self) -> StepResult:
        info: dict[str, Any] = {"termination_reason": "agent_stop"}
        try:
            score = self.domain.score(self.task, self.env, self.calls, [])
        except RecursionError:  # a tool stored a value nested too deep to hash; it cannot be the gold database
            info["reward_info"] = {"error": "the database holds a value nested too deeply to hash"}
            return StepResult("Done.", 0.0, done=True, info=info)
        return StepResult("Done.", score.reward, done=True, info={**info, "reward_info": score.info()})


class Tau2TelecomSoloGym(Tau2SoloGym):
    name = "tau2_telecom_solo"
    domain_name = "telecom"


SOLO_GYMS: dict[str, type[Tau2SoloGym]] = {g.name: g for g in (Tau2SoloGym, Tau2TelecomSoloGym)}


def solo_tasks(gym: str, split: str, root: Path) -> list[Task]:
    """The solo-ready tasks of a split of the domain's `split_tasks.json` (`all`: every task), solo prompts."""
    domain = load_domain(SOLO_GYMS[gym].domain_name, str(root / "tau2"))
    if split != "all" and split not in domain.splits:
        raise NoSuchSplitError(f"gym {gym} has no {split!r} split; its splits: all, {', '.join(domain.splits)}")
    system = Message("system", solo_system(domain.solo_policy))
    tasks = []
    for task_id in domain.split(split):
        task = domain.task(task_id)
        if not solo_ready(task):
            continue
        record = {"id": task_id, "tau2_dir": str(root / "tau2")}
        prompt = [system, Message("user", str(task.get("ticket") or ""))]
        tasks.append(Task(gym, task_id, prompt, solo_tools(domain, task), {"record": record, "data_source": gym}))
    return tasks


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "[answer] " + json.dumps({"name": name, "arguments": arguments})


SMOKE_TASKS = {
    "tau2_mock": "create_task_1",
    "tau2_telecom_solo": "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]",  # a user tool fixes it
}


def solo_smoke(gym: str) -> list[SmokeEpisode]:
    """A task's gold calls (user tools included) then `done` earn 1; a failed call then `done` earns 0 (mock). They
    need the tau2 data."""
    root = tau2_dir()
    domain_name = SOLO_GYMS[gym].domain_name
    if not (root / domain_name).is_dir():
        log.warning("tau2 smoke episodes skipped: no tau2 data in %s", root)
        return []
    task = load_domain(domain_name, str(root)).task(SMOKE_TASKS[gym])
    gold = [_call(a["name"], a.get("arguments", {})) for a in task["evaluation_criteria"]["actions"]]
    done = _call(DONE_TOOL, {})
    episodes = [SmokeEpisode("gold calls, then done", task["id"], [*gold, done], [0.0] * len(gold) + [1.0])]
    if gym == "tau2_mock":
        wrong = _call("update_task_status", {"task_id": "nope", "status": "x"})
        episodes.append(SmokeEpisode("a failed call, then done", task["id"], [wrong, done], [0.0, 0.0]))
    return episodes


for _gym in SOLO_GYMS.values():
    register_gym(
        _gym.name,
        config_type=Tau2GymConfig,
        config_field="tau2",
        tasks=functools.partial(solo_tasks, _gym.name),
        smoke=functools.partial(solo_smoke, _gym.name),
    )(_gym)
