"""The JSON object one simulator call answers with, stated once per call.

A gym states each of its simulator calls as a `ReplySchema` (in its `replies.py`), built from the same constants
its parser checks (Persuade's stances, Turtle's grades, Travel's verdicts, ...). `TurnGym.ask` requires the keys
the gym reads (`needs`), and the client sends the schema as `response_format: json_schema` (`user_sim.structured`),
so the constrained reply and the parser cannot drift apart. The parser stays what it was (UserRL parses free text):
a schema only narrows what the simulator writes, never what the gym accepts from a free-text reply.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

JsonSchema = dict[str, Any]


@dataclass(frozen=True, eq=False)
class ReplySchema:
    """One simulator call's reply: a JSON object with exactly `properties` (in the order the model writes them)."""

    name: str  # the call's name (`json_schema.name`): letters, digits, `_` and `-`
    properties: Mapping[str, JsonSchema]  # each key's JSON schema; every key is required in a structured reply
    needs: tuple[str, ...]  # the keys the gym reads: a free-text reply without one is a simulator error

    def __post_init__(self) -> None:
        unknown = [k for k in self.needs if k not in self.properties]
        if unknown:
            raise ValueError(f"reply schema {self.name}: needs {unknown}, which are not among its properties")

    def schema(self) -> JsonSchema:
        """The JSON schema of the reply (strict: every property required, nothing else allowed)."""
        return {
            "type": "object",
            "properties": {k: dict(v) for k, v in self.properties.items()},
            "required": list(self.properties),
            "additionalProperties": False,
        }

    def response_format(self, max_text_chars: int = 0) -> JsonSchema:
        """The OpenAI `response_format` that constrains a reply to `schema()`; with `max_text_chars`, each free-text
        string (a `text()` anywhere in it) holds at most that many characters (`user_sim.structured_text_chars`)."""
        schema = capped(self.schema(), max_text_chars) if max_text_chars > 0 else self.schema()
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": schema, "strict": True}}


def capped(schema: JsonSchema, max_chars: int) -> JsonSchema:
    """`schema` with `maxLength: max_chars` on each string without an enum (in objects and arrays too): a small
    simulator's thoughts end within its token budget instead of being cut, which no parser reads."""
    out = dict(schema)
    if out.get("type") == "string" and "enum" not in out:
        out["maxLength"] = min(max_chars, out.get("maxLength", max_chars))
    if "properties" in out:
        out["properties"] = {k: capped(v, max_chars) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = capped(out["items"], max_chars)
    return out


def text() -> JsonSchema:
    """Any string."""
    return {"type": "string"}


def one_of(values: Iterable[str | float]) -> JsonSchema:
    """Exactly one of `values` (all strings, or all numbers)."""
    values = list(values)
    kind = "string" if all(isinstance(v, str) for v in values) else "number"
    return {"type": kind, "enum": values}


def boolean() -> JsonSchema:
    """true or false."""
    return {"type": "boolean"}


def integers(maximum: int) -> JsonSchema:
    """A list of at most `maximum` integers, each from 1 to `maximum` (numbers in a list of that many: a small
    simulator, unbounded, counts on until its token limit cuts the reply)."""
    bound = max(1, maximum)
    return {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": bound}, "maxItems": bound}


def objects(properties: Mapping[str, JsonSchema], count: int) -> JsonSchema:
    """A list of exactly `count` objects with exactly `properties`, each required."""
    item: JsonSchema = {"type": "object", "properties": dict(properties), "required": list(properties)}
    item["additionalProperties"] = False
    return {"type": "array", "items": item, "minItems": count, "maxItems": count}
