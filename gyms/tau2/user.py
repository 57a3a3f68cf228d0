"""The simulated user of a conversational tau2 episode (SPEC.md §10): prompt, history and, in dual control, tools.

The system prompt is upstream's guidelines (`user_simulator/simulation_guidelines.md`, or
`simulation_guidelines_tools.md` when the user has tools) followed by the task's user scenario in `<scenario>`.
Roles are flipped: the agent's messages are the simulator's `user` turns, its replies are `assistant` turns. The
history starts with the agent's fixed greeting, so the first reply is the user's opening message.

A user without tools answers in plain text. A user with tools answers with one JSON object (`replies.user_reply`,
schema-constrained where the engine supports it): a message to the agent, or a call of one of its tools. A call
runs in the episode's environment as `requestor="user"`; its result goes back to the simulator only, as a `user`
turn (`TOOL_RESULT`), and the simulator is asked again, until it writes a message. After `max_tool_calls` calls
in one turn the simulator is asked with a schema that admits a message only; a tool call then (free text, where
the schema is not enforced) is a simulator error (kind `user_loop`). An unusable reply (no message, an unknown
tool) is a simulator error (`UserSimError`, kind `bad_json`), never the policy's failure.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyms.reply_schema import ReplySchema
from gyms.tau.user import GREETING
from gyms.tau2.replies import MESSAGE, TOOL_CALL, parse_user_reply, user_reply
from gyms.tau2.toolkit import Observation
from gyms.user_sim import UserSimError

STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")  # any of them in a user message: user_stop
GUIDELINES = "user_simulator/simulation_guidelines.md"
GUIDELINES_TOOLS = "user_simulator/simulation_guidelines_tools.md"
TOOL_RESULT = "Result of your tool call {name}:\n{content}"
REPLY_FORMAT = (
    "## Reply format\n"
    "Reply with exactly one JSON object and nothing else.\n"
    '- To send a message to the agent: {"message": "<your message>", "tool_call": null}\n'
    '- To call one of your tools: {"message": "", "tool_call": {"name": "<tool name>", "arguments": {...}}}\n'
    "The result of a tool call comes back to you only, in a message starting with `Result of your tool call`.\n"
    "Your tools (OpenAI function schemas):\n"
)
SCENARIO_FIELDS = (
    ("domain", "Domain"),
    ("reason_for_call", "Reason for call"),
    ("known_info", "Known info"),
    ("unknown_info", "Unknown info"),
    ("task_instructions", "Task instructions"),
)


def scenario_text(scenario: dict[str, Any]) -> str:
    """A task's `user_scenario` as the simulator reads it: the persona, then the instruction fields."""
    parts = []
    if scenario.get("persona"):
        parts.append(f"Persona:\n{scenario['persona']}")
    instructions = scenario.get("instructions")
    if isinstance(instructions, dict):
        lines = [f"{label}: {instructions[key]}" for key, label in SCENARIO_FIELDS if instructions.get(key)]
        parts.append("Instructions:\n" + "\n".join(lines))
    elif instructions:
        parts.append(f"Instructions:\n{instructions}")
    return "\n\n".join(parts)


def user_prompt(tau2_dir: Path, scenario: dict[str, Any], schemas: list[dict[str, Any]]) -> str:
    """The simulator's system prompt: the guidelines (with tools when `schemas`), the scenario, the reply format."""
    guidelines = (tau2_dir / (GUIDELINES_TOOLS if schemas else GUIDELINES)).read_text(encoding="utf-8").strip()
    prompt = f"{guidelines}\n\n<scenario>\n{scenario_text(scenario)}\n</scenario>"
    if schemas:
        prompt += "\n\n" + REPLY_FORMAT + json.dumps(schemas, indent=1)
    return prompt


def is_stop(message: str) -> bool:
    """Whether a user message ends the conversation (`###STOP###`, `###TRANSFER###`, `###OUT-OF-SCOPE###`)."""
    return any(token in message for token in STOP_TOKENS)


@dataclass
class UserCall:
    """One tool call the user made, with its result."""

    name: str
    arguments: dict[str, Any]
    result: Observation


@dataclass
class UserTurn:
    """What the user did between two agent messages: its tool calls, then its message."""

    message: str
    calls: list[UserCall] = field(default_factory=list)


RunTool = Callable[[str, dict[str, Any]], Observation]


class Tau2User:
    """One episode's simulated user over the shared simulator client."""

    def __init__(
        self,
        user_sim: Any,
        system: str,
        schemas: list[dict[str, Any]],
        max_tool_calls: int,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.user_sim = user_sim
        self.schemas = schemas
        self.tools = {s["function"]["name"] for s in schemas}
        self.reply = user_reply(schemas) if schemas else None
        self.message_only = user_reply([])  # once the turn's tool calls are spent
        self.max_tool_calls = max_tool_calls
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}]

    async def respond(self, agent_message: str, run_tool: RunTool) -> UserTurn:
        """The user's turn after `agent_message`; UserSimError leaves the history as it was."""
        mark = len(self.history)
        self.history.append({"role": "user", "content": agent_message})
        try:
            return await self._turn(run_tool)
        except UserSimError:
            del self.history[mark:]
            raise

    async def opening(self, run_tool: RunTool) -> UserTurn:
        """The user's first turn: its answer to the agent's greeting."""
        return await self.respond(GREETING, run_tool)

    async def resume(self, history: list[tuple[str, str]], run_tool: RunTool) -> UserTurn:
        """The user's first turn after an earlier conversation, `history` its text messages as (role, text) with
        the task's roles (`user`: the user's own, as it would have written them). It ends with the agent's."""
        mark = len(self.history)
        for role, text in history:
            own = role == "user"
            written = json.dumps({MESSAGE: text, TOOL_CALL: None}) if own and self.reply is not None else text
            self.history.append({"role": "assistant" if own else "user", "content": written})
        try:
            return await self._turn(run_tool)
        except UserSimError:
            del self.history[mark:]
            raise

    async def _turn(self, run_tool: RunTool) -> UserTurn:
        turn = UserTurn("")
        while True:
            spent = len(turn.calls) >= self.max_tool_calls
            text, parsed = await self._ask(self.message_only if spent and self.reply is not None else self.reply)
            self.history.append({"role": "assistant", "content": text})
            if isinstance(parsed, str):
                turn.message = parsed
                return turn
            if spent:
                raise UserSimError(
                    f"the simulated user made more than {self.max_tool_calls} tool calls in one turn", "user_loop", 1
                )
            name, arguments = parsed
            result = run_tool(name, arguments)
            turn.calls.append(UserCall(name, arguments, result))
            self.history.append({"role": "user", "content": TOOL_RESULT.format(name=name, content=result.content)})

    async def _ask(self, reply: ReplySchema | None) -> tuple[str, str | tuple[str, dict[str, Any]]]:
        """One simulator call answering `reply` (None: free text): its text and what it says (a message, or a tool
        call)."""
        temperature, max_tokens = self.temperature, self.max_tokens  # None: the simulator's configured values
        if reply is None:
            answer = await self.user_sim.chat(self.history, temperature=temperature, max_tokens=max_tokens)
            return answer.text, answer.text.strip()
        answer = await self.user_sim.chat(
            self.history, temperature=temperature, max_tokens=max_tokens, json=True, schema=reply
        )
        parsed = parse_user_reply(answer.data or {}, self.tools)
        if parsed is None:
            note = getattr(self.user_sim, "unusable_reply", None)
            if note is not None:
                note()
            raise UserSimError(f"simulated user's reply is neither a message nor a call of its tools: "
                               f"{answer.text[:200]!r}", "bad_json", 1)  # fmt: skip
        return answer.text, parsed
