"""The tau gyms: one tau-bench episode behind the gym action grammar.

- `tau` is UserRL's TauGym (`gyms/TauGym` of github.com/SalesforceAIResearch/UserRL): `[search] tools` /
  `[search] help`, `[action] <message to the customer>`, `[answer] {"name": ..., "arguments": {...}}` (or
  `name: {json}`) for a tool call, `[finish]`.
- `tau_retail` and `tau_airline` are the MUA-RL setting: the policy calls the domain tools natively (the rollout
  turns each call into the same `[answer]` JSON) and a plain reply reaches the gym as `[action] <text>`.

An episode ends when the customer says `###STOP###` or `transfer_to_human_agents` is called; that step carries
tau-bench's binary reward (final DB hash equals the gold one, and every required output was said). Every other
step, and a truncated episode, gets 0. A simulator failure gives the fallback feedback, reward 0 and
`StepResult.user_sim_error` (TurnGym).
"""

import functools
import json
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.data import data_dir
from gyms.tau.domain import load_domain
from gyms.tau.settings import TauGymConfig
from gyms.tau.smoke import domain_smoke, tau_smoke
from gyms.tau.tasks import DOMAIN_GYMS, domain_tasks, parse_task_id, record_for, tau_tasks, taubench_dir
from gyms.tau.user import STOP, Customer
from gyms.tools import RESPOND_TOOL
from gyms.turn_gym import TurnGym

TOOLS_ALREADY_LISTED = (
    "Tools information is already provided in previous turns in our conversation. Please directly refer to those "
    "information and do not search for available tools again."
)
INVALID_TOOL_CALL = (
    "Invalid tool call format. Please provide valid JSON format in content when calling the internal tool."
)
RESPOND_WITHOUT_CONTENT = "Error executing tool call: 'content'"  # UserRL's text for tau-bench's KeyError
HELP = (
    "Choose one of these in each step:\n"
    "* search: give 'tools' to list the internal tools with their arguments (once), or 'help' for this guidance.\n"
    "* action: send a message to the user; their reply comes back.\n"
    "* answer: call an internal tool with a JSON object, e.g. "
    '{"name": "tool_name", "arguments": {"arg_1": "value_1"}}; the tool\'s output comes back.\n'
    "Work out what the user wants and which tool call achieves it, then collect the arguments that call needs, "
    "from other tools or by asking the user. Always act through the `interact_with_env` tool."
)


def parse_tool_call(content: str) -> tuple[str, dict[str, Any]] | None:
    """`{"name": n, "arguments": {...}}` or `n: {...}` -> (n, arguments); None when it does not parse.

    Any failure of the JSON reader (malformed text, nesting deeper than it reads, a number over Python's digit
    limit) is "does not parse", as in UserRL (which caught every exception here).
    """
    try:
        if content.startswith("{") and content.endswith("}"):
            call = json.loads(content)
            name, arguments = call.get("name", ""), call.get("arguments", {})
        else:
            name, colon, rest = content.partition(":")
            if not colon:
                return None
            name, arguments = name.strip(), json.loads(rest.strip())
    except (ValueError, RecursionError, AttributeError):
        return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, arguments


class TauGym(TurnGym):
    """Gym `tau`; the domain gyms below change only the action set and the opening observation."""

    name = "tau"
    needs_user_sim = True
    search_enabled = True

    def __init__(self, task: Any, config: TauGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or TauGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, lambda task_id: record_for(task_id, data_dir(self.config.data_dir)))
        domain, split, index = parse_task_id(self.record["id"])
        self.domain = load_domain(domain, str(taubench_dir(self.record, self.config.data_dir)))
        self.task = self.domain.task(split, index)
        self.opening: str = self.record["opening"]
        self.start()

    def start(self) -> None:
        self.db = self.domain.new_db()
        self.said: list[str] = []  # agent messages to the customer (the outputs check reads them)
        self.customer = Customer(
            self.user_sim,
            self.task.instruction,
            self.opening,
            self.config.customer_temperature,
            self.config.customer_max_tokens,
        )
        self.tools_listed = False

    def observation(self) -> str:
        return f"User says: {self.opening}"

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "action":
            return await self._say(payload)
        if tag == "answer":
            return await self._call(payload)
        if tag == "search" and self.search_enabled:
            return StepResult(self._search(payload.lower()), 0.0)
        if tag == "finish":  # UserRL: the last tau-bench reward, which is 0 unless the episode had already ended
            return StepResult("Episode finished. Final reward: 0.0", 0.0, done=True)
        return StepResult(self._invalid(f"[{tag}] {payload}" if tag else payload), 0.0)

    def _invalid(self, action: str) -> str:
        return f"Invalid action format: {action}. Please follow the system instruction to call the interact tool."

    async def _say(self, message: str) -> StepResult:
        reply = await self.customer.reply(message)  # UserSimError: the message was never heard, nothing changes
        self.said.append(message)
        return self._finish(reply) if STOP in reply else StepResult(reply, 0.0)

    async def _call(self, content: str) -> StepResult:
        call = parse_tool_call(content)
        if call is None:
            return StepResult(INVALID_TOOL_CALL, 0.0)
        name, arguments = call
        if name == RESPOND_TOOL:  # tau-bench's message to the user, as a tool call
            message = arguments.get("content")
            if not isinstance(message, str):
                return StepResult(RESPOND_WITHOUT_CONTENT, 0.0, info={"tool": name})
            return await self._say(message)
        observation = self.domain.call(self.db, name, arguments)
        if self.domain.is_terminal(name):
            return self._finish(observation)
        return StepResult(observation, 0.0, info={"tool": name})

    def _finish(self, feedback: str) -> StepResult:
        try:
            score = self.domain.score(self.task, self.db, self.said)
        except RecursionError:  # a tool stored a value nested too deep to hash; it cannot be the gold database
            info = {"r_actions": 0.0, "error": "the database holds a value nested too deeply to hash"}
            return StepResult(feedback, 0.0, done=True, info={"reward_info": info})
        return StepResult(feedback, score.reward, done=True, info={"reward_info": score.info()})

    def _search(self, query: str) -> str:
        if query == "help":
            return HELP
        if query != "tools":
            return (
                f"Search not supported for '{query}'. Please search for available tools by providing 'tools' in "
                "content or show help information by providing 'help' in content."
            )
        if self.tools_listed:
            return TOOLS_ALREADY_LISTED
        self.tools_listed = True
        lines = ["Available Tools:"]
        for schema in self.domain.schemas:
            function = schema.get("function", {})
            lines.append(f"- {function.get('name', 'unknown')}: {function.get('description', 'No description')}")
            params = function.get("parameters", {}).get("properties", {})
            if params:
                lines.append("  Parameters:")
                lines += [f"    - {p}: {spec.get('description', '')}" for p, spec in params.items()]
        return "\n".join(lines)


class TauDomainGym(TauGym):
    """Gyms `tau_retail` / `tau_airline`: native domain tools; the opening line is the first observation."""

    search_enabled = False

    def __init__(self, task: Any, config: TauGymConfig | None = None, user_sim: Any = None) -> None:
        super().__init__(task, config, user_sim)
        if self.domain.name != DOMAIN_GYMS[self.name]:
            raise ValueError(f"gym {self.name} runs {DOMAIN_GYMS[self.name]} tasks, got {self.record['id']!r}")

    def observation(self) -> str:
        return self.opening

    def _invalid(self, action: str) -> str:
        return f"Invalid action: {action}. Call one of the tools, or write a message to the customer."


class TauRetailGym(TauDomainGym):
    name = "tau_retail"


class TauAirlineGym(TauDomainGym):
    name = "tau_airline"


register_gym(
    "tau", config_type=TauGymConfig, needs_user_sim=True, userrl_env="TauGym", tasks=tau_tasks, smoke=tau_smoke
)(TauGym)
for _gym in (TauRetailGym, TauAirlineGym):
    register_gym(
        _gym.name,
        config_type=TauGymConfig,
        config_field="tau",
        needs_user_sim=True,
        tasks=functools.partial(domain_tasks, _gym.name),
        smoke=functools.partial(domain_smoke, _gym.name),
    )(_gym)
