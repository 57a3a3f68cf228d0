"""tau2's conversational gyms, with the simulated user (the solo ones: gyms.tau2.solo).

`tau2_airline`, `tau2_retail`, `tau2_telecom` and `tau2_mock_chat`: half-duplex text
mode (SPEC.md §10). The policy sees the agent instructions with the domain policy, the domain tools, its own
greeting, and the simulated user's first message, asked for at reset (`first_message_at_reset`: the rollout
appends it to the prompt). A tool call runs in the episode's environment; a plain message (`[action] <text>`) goes
to the simulated user (gyms.tau2.user), who may call its own tools first (dual control). The episode ends as tau2
reports (`info["termination_reason"]`): `agent_stop` (the agent wrote `###STOP###`), `user_stop` (the user wrote
`###STOP###`, `###TRANSFER###` or `###OUT-OF-SCOPE###`), `max_steps`, `too_many_errors` (`max_errors` tool results
with an error, both parties counted) or `infrastructure_error` (the simulator failed: `StepResult.user_sim_error`,
never scored). Only the two stops are scored; the others end with reward 0. The final step carries tau2's reward
(Domain.score), with NL_ASSERTION graded by the judge (gyms.tau2.judge) when `nl_judge` is on.
"""

import functools
import json
import logging
from pathlib import Path
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.data import NoSuchSplitError
from gyms.smoke import SmokeEpisode, by_prompt
from gyms.tau.gym import INVALID_TOOL_CALL, parse_tool_call
from gyms.tau.user import GREETING
from gyms.tau2.domain import Domain, load_domain, tau2_dir
from gyms.tau2.judge import judge
from gyms.tau2.settings import Tau2GymConfig
from gyms.tau2.toolkit import Observation
from gyms.tau2.user import Tau2User, UserTurn, is_stop, user_prompt
from gyms.turn_gym import TurnGym
from gyms.user_sim import UserSimError
from userrl_megatron.types import Message, Task

log = logging.getLogger(__name__)

AGENT_STOP = "###STOP###"  # in an agent message: the agent ends the conversation (agent_stop)
AGENT_INSTRUCTIONS = (
    "You are a customer service agent. Help the user by following the policy below.\n"
    "In each turn, either send a message to the user or make one tool call; never both.\n"
    "Only call the tools you are given, and only act as the policy allows.\n"
    f"When the conversation is over, end it with a message that contains {AGENT_STOP}."
)
EMPTY_MESSAGE = "Invalid action: an empty message. Write a message to the user, or call a tool."
INVALID_ACTION = "Invalid action: {action}. Call one of the tools, or write a message to the user."


def agent_system(policy: str) -> str:
    """The policy's system prompt: the agent instructions, then the domain policy in `<policy>`."""
    return f"{AGENT_INSTRUCTIONS}\n\n<policy>\n{policy}\n</policy>"


def message_history(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The task's earlier conversation (`initial_state.message_history`, SPEC.md §8); [] for most tasks."""
    return list((task.get("initial_state") or {}).get("message_history") or [])


def history_texts(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The text messages of an earlier conversation, as (role, text)."""
    return [
        (m["role"], str(m["content"]))
        for m in history
        if m.get("role") in ("user", "assistant") and not m.get("tool_calls") and m.get("content")
    ]


def history_prompt(task: dict[str, Any]) -> list[Message]:
    """The earlier conversation as the policy's prompt continues it: the texts, the agent's tool calls (OpenAI
    form, arguments as a JSON string: the chat template writes them in the policy's tool format) and their
    results. It ends with the agent's text, which the simulated user answers at reset."""
    messages = []
    for m in message_history(task):
        role, content = m.get("role"), str(m.get("content") or "")
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                {
                    "id": c.get("id", ""),
                    "type": "function",
                    "function": {
                        "name": c["name"],
                        "arguments": json.dumps(c.get("arguments") or {}, ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            messages.append(Message("assistant", content, tool_calls=calls))
        elif role == "tool":
            messages.append(Message("tool", content, tool_call_id=str(m.get("id", ""))))
        elif role in ("user", "assistant"):
            messages.append(Message(role, content))
    if not messages or messages[-1].role != "assistant" or messages[-1].tool_calls:
        raise ValueError(f"tau2 task {task.get('id')!r}: a message history must end with the agent's text message")
    return messages


class Tau2ChatGym(TurnGym):
    """One tau2 task as a conversation with the simulated user (see the module docstring)."""

    domain_name = ""
    needs_user_sim = True
    first_message_at_reset = True  # reset() returns the user's first message; the rollout appends it to the prompt

    def __init__(self, task: Any, config: Tau2GymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or Tau2GymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, lambda task_id: {"id": task_id})
        self.root = Path(self.record.get("tau2_dir") or str(tau2_dir(self.config.data_dir)))
        self.domain: Domain = load_domain(self.domain_name, str(self.root))
        self.task = self.domain.task(self.record["id"])
        self.user_schemas = self.domain.task_user_schemas(self.task)
        self.user_system = user_prompt(self.root, self.task.get("user_scenario") or {}, self.user_schemas)
        self.history = message_history(self.task)  # an earlier conversation this episode continues ([]: none)
        self.earlier = history_texts(self.history)
        self.start()

    def start(self) -> None:
        self.env = self.domain.new_env(self.task)  # a message history's tool calls are replayed into it
        # Both parties' tool calls, failed ones too (ACTION); the history's count, as in upstream's trajectory.
        self.calls: list[tuple[str, dict[str, Any]]] = [
            (c["name"], c.get("arguments") or {}) for m in self.history for c in m.get("tool_calls") or []
        ]
        self.said: list[str] = [text for role, text in self.earlier if role == "assistant"]  # COMMUNICATE
        # Text messages (the NL judge): the history's, or the greeting.
        self.transcript: list[tuple[str, str]] = list(self.earlier) if self.history else [("assistant", GREETING)]
        self.errors = 0  # tool results with an error, both parties
        self.opening = ""
        self.opening_calls: list[str] = []  # the user's tool calls before its first message (the first step names them)
        self.user = Tau2User(
            self.user_sim,
            self.user_system,
            self.user_schemas,
            self.config.max_user_tool_calls,
            self.config.user_temperature,
            self.config.user_max_tokens,
        )

    async def reset(self) -> str:
        """Start the episode and ask the simulated user for its first message (UserSimError when it fails, or
        when that message already ends the conversation)."""
        await super().reset()
        if self.history:  # the user answers the history's last message, the agent's
            turn = await self.user.resume(self.earlier, self._user_tool)
        else:
            turn = await self.user.opening(self._user_tool)
        if is_stop(turn.message):  # nothing the agent did could be scored: the simulator's failure, not the policy's
            raise UserSimError(
                f"the simulated user ended the conversation at once: {turn.message[:200]!r}", "early_stop", 1
            )
        self._heard(turn)
        self.opening = turn.message
        self.opening_calls = [c.name for c in turn.calls]
        return self.opening

    def observation(self) -> str:
        return self.opening

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if self.opening_calls:  # reset() has no info of its own: the first step names the opening's calls
            result.info["opening_user_tool_calls"], self.opening_calls = self.opening_calls, []
        if result.user_sim_error is not None:
            result.info["termination_reason"] = "infrastructure_error"
        elif result.truncated and not result.done:
            result.info["termination_reason"] = "max_steps"
        return result

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "action":
            return await self._say(payload)
        if tag == "answer":
            return self._call(payload)
        return StepResult(INVALID_ACTION.format(action=f"[{tag}] {payload}" if tag else payload), 0.0)

    def _user_tool(self, name: str, arguments: dict[str, Any]) -> Observation:
        return self.env.call(name, arguments, requestor="user")

    def _heard(self, turn: UserTurn) -> None:
        """Record a finished user turn: its tool calls, then its message."""
        for call in turn.calls:
            self.calls.append((call.name, call.arguments))
            self.errors += call.result.error
        self.transcript.append(("user", turn.message))

    async def _say(self, message: str) -> StepResult:
        if not message.strip():
            return StepResult(EMPTY_MESSAGE, 0.0)
        if AGENT_STOP in message:
            self._spoke(message)
            return await self._finish("agent_stop", "")
        turn = await self.user.respond(message, self._user_tool)  # UserSimError: unheard, the agent's side unchanged
        self._spoke(message)
        self._heard(turn)
        info: dict[str, Any] = {"user_tool_calls": [c.name for c in turn.calls]} if turn.calls else {}
        if is_stop(turn.message):
            return await self._finish("user_stop", turn.message, info)
        if self.errors >= self.config.max_errors:
            return self._end("too_many_errors", turn.message, info)
        return StepResult(turn.message, 0.0, info=info)

    def _spoke(self, message: str) -> None:
        self.said.append(message)
        self.transcript.append(("assistant", message))

    def _call(self, payload: str) -> StepResult:
        call = parse_tool_call(payload)
        if call is None:
            return StepResult(INVALID_TOOL_CALL, 0.0)
        name, arguments = call
        self.calls.append((name, arguments))
        out = self.env.call(name, arguments)
        self.errors += out.error
        info: dict[str, Any] = {"tool": name, "tool_error": out.error}
        if self.errors >= self.config.max_errors:
            return self._end("too_many_errors", out.content, info)
        return StepResult(out.content, 0.0, info=info)

    def _end(self, reason: str, feedback: str, info: dict[str, Any] | None = None) -> StepResult:
        """An ending tau2 does not score: reward 0."""
        return StepResult(feedback, 0.0, done=True, info={**(info or {}), "termination_reason": reason})

    async def _finish(self, reason: str, feedback: str, info: dict[str, Any] | None = None) -> StepResult:
        """A scored ending: tau2's reward, NL_ASSERTION by the judge when `nl_judge` is on."""
        info = {**(info or {}), "termination_reason": reason}
        try:
            score = self.domain.score(self.task, self.env, self.calls, self.said)
        except RecursionError:  # a tool stored a value nested too deep to hash; it cannot be the gold database
            info["reward_info"] = {"error": "the database holds a value nested too deeply to hash"}
            return StepResult(feedback, 0.0, done=True, info=info)
        reward, reward_info = score.reward, score.info()
        if "NL_ASSERTION" in reward_info["unscored"] and self.config.nl_judge:
            assertions = list((self.task.get("evaluation_criteria") or {}).get("nl_assertions") or [])
            met, graded = await judge(self.user_sim, self.transcript, assertions, self.config.nl_judge_max_tokens)
            reward *= met
            reward_info["components"]["NL_ASSERTION"] = met
            reward_info["unscored"].remove("NL_ASSERTION")
            reward_info["nl_assertions"] = graded
        info["reward_info"] = reward_info
        return StepResult(feedback, reward, done=True, info=info)


class Tau2MockChatGym(Tau2ChatGym):
    name = "tau2_mock_chat"
    domain_name = "mock"


class Tau2AirlineGym(Tau2ChatGym):
    name = "tau2_airline"
    domain_name = "airline"


class Tau2RetailGym(Tau2ChatGym):
    name = "tau2_retail"
    domain_name = "retail"


class Tau2TelecomGym(Tau2ChatGym):
    name = "tau2_telecom"
    domain_name = "telecom"


CHAT_GYMS: dict[str, type[Tau2ChatGym]] = {
    g.name: g for g in (Tau2MockChatGym, Tau2AirlineGym, Tau2RetailGym, Tau2TelecomGym)
}


def chat_tasks(gym: str, split: str, root: Path) -> list[Task]:
    """The tasks of a split of the domain's `split_tasks.json` (`all`: every task), conversational prompts."""
    domain = load_domain(CHAT_GYMS[gym].domain_name, str(root / "tau2"))
    if split != "all" and split not in domain.splits:
        raise NoSuchSplitError(f"gym {gym} has no {split!r} split; its splits: all, {', '.join(domain.splits)}")
    system = Message("system", agent_system(domain.policy))
    record = {"tau2_dir": str(root / "tau2")}
    metadata = {"data_source": gym, "reply_without_tool_call": "action"}
    tasks = []
    for task_id in domain.split(split):
        task = domain.task(task_id)
        prompt = [system, *history_prompt(task)] if message_history(task) else [system, Message("assistant", GREETING)]
        tasks.append(
            Task(gym, task_id, prompt, list(domain.schemas), {**metadata, "record": {**record, "id": task_id}})
        )
    return tasks


SMOKE_TASKS = {"tau2_airline": "1", "tau2_retail": "0"}  # gold calls, then the agent stops: reward 1
TELECOM_SMOKE = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"  # the user's own call fixes it


def chat_smoke(gym: str) -> list[SmokeEpisode]:
    """Scripted conversations that earn 1 (they need the tau2 data): mock, a tool call and a confirmation; airline
    and retail, a task's gold calls and the agent's stop; telecom, the user turns roaming on at the agent's word."""
    root = tau2_dir()
    domain_name = CHAT_GYMS[gym].domain_name
    if not (root / domain_name).is_dir():
        return []
    title = "a tool call, a confirmation, the user stops"
    if gym in SMOKE_TASKS:
        task = load_domain(domain_name, str(root)).task(SMOKE_TASKS[gym])
        actions = [
            "[answer] " + json.dumps({"name": a["name"], "arguments": a.get("arguments", {})})
            for a in task["evaluation_criteria"]["actions"]
        ]
        script = by_prompt({"<scenario>": ["Hello, I need help."]})  # a user without tools: plain text
        rewards = [0.0] * len(actions) + [1.0]
        return [SmokeEpisode("gold calls, then the agent stops", task["id"], [*actions, f"[action] Done. {AGENT_STOP}"],
                             rewards, script=script)]  # fmt: skip
    if gym == "tau2_telecom":
        said = [
            {"message": "My mobile data does not work abroad.", "tool_call": None},
            {"message": "", "tool_call": {"name": "toggle_roaming", "arguments": {}}},
            {"message": "It works now. ###STOP###", "tool_call": None},
        ]
        script = by_prompt({"<scenario>": [json.dumps(m) for m in said]})
        actions = ["[action] Please turn data roaming on."]
        return [
            SmokeEpisode("the user's own tool call, then the user stops", TELECOM_SMOKE, actions, [1.0], script=script)
        ]
    create = {"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}
    said = [
        {"message": m, "tool_call": None}
        for m in ("Please create 'Important Meeting' for user_1.", "Thanks! ###STOP###")
    ]
    script = by_prompt({"<scenario>": [json.dumps(m) for m in said]})  # mock's user has tools: JSON replies
    actions = ["[answer] " + json.dumps(create), "[action] Done: task_2 'Important Meeting' is created."]
    return [SmokeEpisode(title, "create_task_1", actions, [0.0, 1.0], script=script)]


for _gym in CHAT_GYMS.values():
    register_gym(
        _gym.name,
        config_type=Tau2GymConfig,
        config_field="tau2",
        needs_user_sim=True,
        tasks=functools.partial(chat_tasks, _gym.name),
        smoke=functools.partial(chat_smoke, _gym.name),
    )(_gym)
