"""How tau tools are declared and invoked, and the tools both domains share.

A tool is a plain function `fn(data, **arguments) -> str` over an `EpisodeDB`. Arguments are not checked against
the JSON schema (tau-bench does not either); a call that raises becomes the observation `Error: <message>`.
Each tool function carries tau-bench's class name as its qualified name (`CancelPendingOrder.invoke`), and in a
domain's table (`tool_table`) tau-bench's module of that tool (`tau_bench.envs.retail.tools.cancel_pending_order`),
so that Python's own argument errors read exactly as tau-bench's do, e.g.
`Error: CancelPendingOrder.invoke() missing 1 required positional argument: 'reason'` and, for a call that passes
its own `data`, `Error: tau_bench.envs.retail.tools.think.Think.invoke() got multiple values for keyword argument
'data'`.
"""

import json
import types
from collections.abc import Callable, Iterable
from typing import Any

from gyms.tau import arithmetic
from gyms.tau.store import EpisodeDB

ToolFn = Callable[..., str]
TERMINATE_TOOL = "transfer_to_human_agents"


def tool(fn: ToolFn) -> ToolFn:
    """Name a tool function like tau-bench's tool class (`snake_name` -> `SnakeName.invoke`)."""
    fn.__qualname__ = "".join(part.title() for part in fn.__name__.split("_")) + ".invoke"
    return fn


def tool_table(domain: str, fns: Iterable[ToolFn]) -> dict[str, ToolFn]:
    """A domain's tools by name, each a copy whose module is tau-bench's module of that tool in that domain.

    Python names a function with its module in some argument errors (a second `data`); the shared tools appear in
    both domains, under a different tau-bench module in each, hence copies.
    """
    table: dict[str, ToolFn] = {}
    for fn in fns:
        named = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        named.__qualname__, named.__doc__, named.__kwdefaults__ = fn.__qualname__, fn.__doc__, fn.__kwdefaults__
        named.__module__ = f"tau_bench.envs.{domain}.tools.{fn.__name__}"
        table[fn.__name__] = named
    return table


def invoke(tools: dict[str, ToolFn], db: EpisodeDB, name: str, arguments: dict[str, Any]) -> str:
    """Run one tool call on an episode database; never raises (errors are observations)."""
    fn = tools.get(name) if isinstance(name, str) else None
    if fn is None:
        return f"Unknown action {name}"
    try:
        out = fn(data=db, **arguments)
    except Exception as e:
        return f"Error: {e}"
    return out


# --- shared tools -------------------------------------------------------------------------------------------


@tool
def calculate(data: EpisodeDB, expression: str) -> str:
    """Evaluate arithmetic (digits, + - * / ( ) . and spaces); the result rounded to 2 decimals.

    tau-bench's checks and `eval` semantics, evaluated within fixed budgets (gyms.tau.arithmetic).
    """
    if not all(c in arithmetic.ALLOWED_CHARS for c in expression):
        return "Error: invalid characters in expression"
    try:
        if not isinstance(expression, str):  # what tau-bench's eval() says about e.g. a list
            raise TypeError("eval() arg 1 must be a string, bytes or code object")
        return str(round(float(arithmetic.evaluate(expression)), 2))
    except Exception as e:
        return f"Error: {e}"


@tool
def get_user_details(data: EpisodeDB, user_id: str) -> str:
    """A user record as JSON (both domains have a `users` table)."""
    users = data["users"]
    return json.dumps(users[user_id]) if user_id in users else "Error: user not found"


@tool
def think(data: EpisodeDB, thought: str) -> str:
    """A scratchpad: changes nothing and returns nothing."""
    return ""


@tool
def transfer_to_human_agents(data: EpisodeDB, summary: str) -> str:
    """Hand the customer to a human; ends the episode."""
    return "Transfer successful"


SHARED_TOOLS: dict[str, ToolFn] = {
    f.__name__: f for f in (calculate, get_user_details, think, transfer_to_human_agents)
}
