"""How tau2 tools are declared, invoked and their results serialised (SPEC.md §1).

A tool is `fn(db, **arguments)` over a `Tau2DB`, returning a string (sent unchanged) or dump-shaped records
(sent as `json.dumps(value, default=str)`). Arguments are not checked against the schema; an exception becomes
`Error: <text>`. Each function carries upstream's qualified name (`AirlineTools.get_user_details`) so that Python's
own argument errors read as upstream's do.
"""

import json
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gyms.tau import arithmetic
from gyms.tau2.store import Tau2DB

ToolFn = Callable[..., Any]


@dataclass(frozen=True)
class Observation:
    """One tool result as the environment returns it."""

    content: str
    error: bool


def toolkit(cls: str, fns: Iterable[ToolFn]) -> dict[str, ToolFn]:
    """A toolkit's functions by name, each named `<cls>.<name>` like upstream's methods."""
    table: dict[str, ToolFn] = {}
    for fn in fns:  # a copy each: the shared tools appear in several toolkits
        named = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        named.__qualname__, named.__doc__, named.__kwdefaults__ = f"{cls}.{fn.__name__}", fn.__doc__, fn.__kwdefaults__
        table[fn.__name__] = named
    return table


def serialise(value: Any) -> str:
    """Upstream's `to_json_str` for the values these tools return."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def invoke(
    tools: dict[str, ToolFn],
    db: Tau2DB,
    name: Any,
    arguments: dict[str, Any],
    after: Callable[[], None] | None = None,
) -> Observation:
    """Run one tool call, then `after` (telecom's sync) if it succeeded; never raises (errors are observations)."""
    fn = tools.get(name) if isinstance(name, str) else None
    if fn is None:
        return Observation(f"Error: Tool '{name}' not found.", True)
    try:
        result = fn(db, **arguments)
        if after is not None:
            after()
        return Observation(serialise(result), False)
    except Exception as e:  # upstream: any exception is the observation
        return Observation(f"Error: {e}", True)


def calculate(db: Tau2DB, expression: str) -> str:
    """Arithmetic (digits, + - * / ( ) . and spaces) rounded to 2 decimals, within gyms.tau's bounds."""
    if not all(c in arithmetic.ALLOWED_CHARS for c in expression):
        raise ValueError("Invalid characters in expression")
    return str(round(float(arithmetic.evaluate(expression)), 2))


def transfer_to_human_agents(db: Tau2DB, summary: str) -> str:
    """Hand the customer to a human (does not end the episode by itself)."""
    return "Transfer successful"
