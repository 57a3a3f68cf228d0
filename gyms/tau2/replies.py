"""The JSON objects the tau2 gyms' simulator calls answer with (gyms/reply_schema.py).

- `user_reply(schemas)`: a simulated user who has tools (dual control) writes a message to the agent or calls one
  of its tools: `{"message": "...", "tool_call": null}` or `{"message": "", "tool_call": {"name", "arguments"}}`.
  `user_reply([])` admits the message only: what the user is asked for once its turn's tool calls are spent.
- `judgement(n)`: the NL-assertion judge grades `n` expected outcomes: `{"results": [{"expectedOutcome",
  "reasoning", "metExpectation"}, ...]}` (SPEC.md §9.2, item 5).

The parsers (`parse_user_reply`, `parse_judgement`) accept exactly what the schemas admit, from free text too.
"""

from typing import Any

from gyms.reply_schema import JsonSchema, ReplySchema, boolean, objects, text

MESSAGE, TOOL_CALL = "message", "tool_call"
RESULTS = "results"
JUDGED = {"expectedOutcome": text(), "reasoning": text(), "metExpectation": boolean()}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with each `{"$ref": "#/$defs/<name>"}` replaced by that definition and `title` keys dropped (a
    tool's parameters become one self-contained part of the reply's schema)."""
    if isinstance(schema, list):
        return [_inline(item, defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref", "")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and ref.removeprefix("#/$defs/") in defs:
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _inline({**defs[ref.removeprefix("#/$defs/")], **rest}, defs)
    return {k: _inline(v, defs) for k, v in schema.items() if k not in ("title", "$defs")}


def _arguments(parameters: dict[str, Any]) -> JsonSchema:
    """A tool's parameters as a closed, self-contained object schema."""
    inlined = _inline(parameters, parameters.get("$defs") or {})
    return {
        "type": "object",
        "properties": inlined.get("properties") or {},
        "required": list(parameters.get("required") or []),
        "additionalProperties": False,
    }


def user_reply(schemas: list[dict[str, Any]]) -> ReplySchema:
    """The reply of a user who has the tools `schemas` (OpenAI function schemas)."""
    calls: list[JsonSchema] = [{"type": "null"}]
    for schema in schemas:
        function = schema["function"]
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "arguments": _arguments(function.get("parameters") or {}),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if len(calls) == 1:
        return ReplySchema("tau2_user_message", {MESSAGE: text(), TOOL_CALL: calls[0]}, needs=(MESSAGE,))
    return ReplySchema("tau2_user", {MESSAGE: text(), TOOL_CALL: {"anyOf": calls}}, needs=(MESSAGE,))


def parse_user_reply(data: dict[str, Any], tools: set[str]) -> tuple[str, dict[str, Any]] | str | None:
    """(name, arguments) for a call of one of `tools`; the message text otherwise; None when the reply is unusable.

    A reply with a tool call and a message is a tool call (upstream: the message is not shown to the agent).
    """
    call = data.get(TOOL_CALL)
    if isinstance(call, dict):
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(name, str) and name in tools and isinstance(arguments, dict):
            return name, arguments
        return None
    if call is not None:
        return None
    message = data.get(MESSAGE)
    if not isinstance(message, str) or not message.strip():
        return None
    return message.strip()


def judgement(count: int) -> ReplySchema:
    """The judge's grades of `count` assertions, in their order."""
    return ReplySchema("tau2_nl_judge", {RESULTS: objects(JUDGED, count)}, needs=(RESULTS,))


def parse_judgement(data: dict[str, Any], count: int) -> list[dict[str, Any]] | None:
    """The `count` graded results, each with a boolean `metExpectation`; None when the reply is unusable."""
    results = data.get(RESULTS)
    if not isinstance(results, list) or len(results) != count:
        return None
    if not all(isinstance(r, dict) and isinstance(r.get("metExpectation"), bool) for r in results):
        return None
    return results
