"""SFT rows on disk: OpenAI-style `messages` (+ `tools`) as JSON lines or parquet, checked row by row.

A row is `{"messages": [{"role", "content", "tool_calls"?, "name"?}, ...], "tools": [schema, ...]?}`; in parquet
`messages` and `tools` may also be JSON strings. UserRL's own SFT data (LLaMA-Factory's ShareGPT layout:
`conversations` of `{from: human|gpt|function_call|observation|system, value}`, a `system` prompt and a `tools`
JSON string) is read too. A row that cannot be trained on is rejected with its file, row number (1-based) and
reason; the caller reports how many were rejected, never skipping one silently.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from userrl_megatron.errors import UserError
from userrl_megatron.types import Message, Role

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES: dict[str, Role] = {
    "human": "user",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
}
SHAREGPT_ROLES |= {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SUFFIXES = (".jsonl", ".parquet")


class RowError(ValueError):
    """Why one row cannot be trained on."""


@dataclass
class SFTRow:
    """One conversation to train on: the assistant messages are the trained ones."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""  # "<file>:<row>" for messages about it


@dataclass
class Rejection:
    """A row left out, and why."""

    source: str  # "<file>:<row>"
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


def read_raw_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, decoded row) of a .jsonl or .parquet file; a line that is not JSON yields its
    RowError instead of a row, so the caller can reject it like any other bad row."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise UserError(f"SFT data {path}: expected a {' or '.join(SUFFIXES)} file")
    if not path.is_file():
        raise UserError(f"SFT data {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield number, row
        return
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as e:
                yield number, RowError(f"not valid JSON ({e})")


def parse_row(raw: Any) -> tuple[list[Message], list[dict[str, Any]]]:
    """The messages and tools of one decoded row; RowError says what is wrong with it."""
    if isinstance(raw, RowError):
        raise raw
    if not isinstance(raw, dict):
        raise RowError(f"a row must be a JSON object, got {type(raw).__name__}")
    tools = _tools(raw.get("tools"))
    if "messages" in raw:
        messages = [_message(m, i) for i, m in enumerate(_list(raw["messages"], "messages"))]
    elif "conversations" in raw:
        messages = _sharegpt(raw)
    else:
        raise RowError('no "messages" (OpenAI style) or "conversations" (ShareGPT style)')
    check_conversation(messages)
    return messages, tools


def check_conversation(messages: list[Message]) -> None:
    """A trainable conversation: a prompt (system/user messages) first, then at least one assistant message."""
    if not messages:
        raise RowError("messages is empty")
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    if first is None:
        raise RowError("no assistant message: nothing to train on")
    if first == 0 or any(m.role not in ("system", "user") for m in messages[:first]):
        raise RowError("the messages before the first assistant message must be system or user messages (a prompt)")
    for i, (a, b) in enumerate(zip(messages[first:], messages[first + 1 :], strict=False), start=first):
        if a.role == "assistant" and b.role == "assistant":
            raise RowError(f"messages[{i}] and [{i + 1}] are both assistant messages (no reply between the turns)")
        if b.role == "system":
            raise RowError(f"messages[{i + 1}]: a system message after the prompt")


def read_rows(path: str | Path) -> tuple[list[SFTRow], list[Rejection]]:
    """Every valid row of a file and a Rejection for each invalid one."""
    rows, rejected = [], []
    for number, raw in read_raw_rows(path):
        source = f"{path}:{number}"
        try:
            messages, tools = parse_row(raw)
        except RowError as e:
            rejected.append(Rejection(source, str(e)))
            continue
        rows.append(SFTRow(messages, tools, source))
    return rows, rejected


def row_to_json(row: SFTRow) -> dict[str, Any]:
    """The OpenAI-style JSON of a row (what `read_rows` reads back)."""
    out: dict[str, Any] = {"messages": [m.to_dict() for m in row.messages]}
    if row.tools:
        out["tools"] = row.tools
    return out


def write_rows(path: str | Path, rows: list[SFTRow]) -> Path:
    """Write rows as JSON lines (atomically: a temporary file renamed into place)."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise UserError(f"{path}: SFT rows are written as .jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row_to_json(row), ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _list(value: Any, name: str) -> list[Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RowError(f"{name} is a string but not JSON ({e})") from e
    if not isinstance(value, list):
        raise RowError(f"{name} must be a list, got {type(value).__name__}")
    return value


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None or value == "" or value == []:
        return []
    tools = _list(value, "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RowError(f"tools[{i}] must be an object (an OpenAI function schema)")
        if "function" not in tool and "name" in tool:  # a bare function schema (LLaMA-Factory writes these)
            tools[i] = {"type": "function", "function": tool}
        elif not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
            raise RowError(f'tools[{i}] needs "function": {{"name": ...}}')
    return tools


def _message(raw: Any, i: int) -> Message:
    if not isinstance(raw, dict):
        raise RowError(f"messages[{i}] must be an object, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise RowError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
    content = raw.get("content")
    calls = raw.get("tool_calls") or None
    if content is None and role == "assistant" and calls:
        content = ""
    if not isinstance(content, str):
        raise RowError(f"messages[{i}].content must be a string, got {type(content).__name__}")
    if calls is not None:
        if role != "assistant":
            raise RowError(f"messages[{i}]: only assistant messages carry tool_calls")
        calls = _list(calls, f"messages[{i}].tool_calls")
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RowError(f'messages[{i}].tool_calls[{k}] needs "function": {{"name": ..., "arguments": ...}}')
    if role == "assistant" and not content and not calls:
        raise RowError(f"messages[{i}]: an assistant message with neither content nor tool_calls")
    name = raw.get("name")
    return Message(role, content, tool_calls=calls, name=name if isinstance(name, str) else None)


def _sharegpt(raw: dict[str, Any]) -> list[Message]:
    messages = []
    system = raw.get("system")
    if system:
        if not isinstance(system, str):
            raise RowError("system must be a string")
        messages.append(Message("system", system))
    for i, turn in enumerate(_list(raw["conversations"], "conversations")):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise RowError(f'conversations[{i}] must be an object with a string "value"')
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise RowError(f"conversations[{i}].from must be one of {', '.join(SHAREGPT_ROLES)}, got {speaker!r}")
        if speaker == "function_call":  # LLaMA-Factory: the value is the call's JSON {"name", "arguments"}
            try:
                call = json.loads(turn["value"])
            except ValueError as e:
                raise RowError(f"conversations[{i}]: a function_call value must be JSON ({e})") from e
            calls = call if isinstance(call, list) else [call]
            if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
                raise RowError(f'conversations[{i}]: a function_call needs "name"')
            tool_calls = [{"type": "function", "function": c} for c in calls]
            messages.append(Message("assistant", "", tool_calls=tool_calls))
            continue
        messages.append(Message(SHAREGPT_ROLES[speaker], turn["value"]))
    return messages
