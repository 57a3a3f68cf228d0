"""How tau tools are declared and invoked, and the tools both domains share.

A tool is a plain function `fn(data, **arguments) -> str` over an `EpisodeDB`. Arguments are not checked against
the JSON schema (tau-bench does not either); a call that raises becomes the observation `Error: <message>`.
Each tool function carries tau-bench's class name as its qualified name (`CancelPendingOrder.invoke`) so that
Python's own argument errors read exactly as tau-bench's do, e.g.
`Error: CancelPendingOrder.invoke() missing 1 required positional argument: 'reason'`.
"""

import ast
import json
import operator
from collections.abc import Callable
from typing import Any

from gyms.tau.store import EpisodeDB

ToolFn = Callable[..., str]
TERMINATE_TOOL = "transfer_to_human_agents"


def tool(fn: ToolFn) -> ToolFn:
    """Name a tool function like tau-bench's tool class (`snake_name` -> `SnakeName.invoke`)."""
    fn.__qualname__ = "".join(part.title() for part in fn.__name__.split("_")) + ".invoke"
    return fn


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

_CALC_CHARS = frozenset("0123456789+-*/(). ")
_MAX_POWER_BITS = 1 << 20  # a larger integer power could stall the process; such a result cannot be a float anyway
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _power(base: Any, exponent: Any) -> Any:
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and exponent > 0
        and exponent * max(base.bit_length() - 1, 0) > _MAX_POWER_BITS
    ):
        raise OverflowError("int too large to convert to float")
    return base**exponent


def _evaluate(node: ast.AST) -> Any:
    """Python's evaluation of the expressions the allowed characters can form, with a bounded `**`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e) for e in node.elts)
    if isinstance(node, ast.Call):  # e.g. "(2)(3)": Python evaluates the callee and its arguments, then fails
        callee = _evaluate(node.func)
        for arg in node.args:
            value = _evaluate(arg.value if isinstance(arg, ast.Starred) else arg)
            if isinstance(arg, ast.Starred):
                raise TypeError(f"Value after * must be an iterable, not {type(value).__name__}")
        for kw in node.keywords:
            value = _evaluate(kw.value)
            raise TypeError(f"argument after ** must be a mapping, not {type(value).__name__}")
        raise TypeError(f"'{type(callee).__name__}' object is not callable")
    raise TypeError(f"unsupported expression: {type(node).__name__}")


@tool
def calculate(data: EpisodeDB, expression: str) -> str:
    """Evaluate arithmetic (digits, + - * / ( ) . and spaces); the result rounded to 2 decimals."""
    if not all(c in _CALC_CHARS for c in expression):
        return "Error: invalid characters in expression"
    try:
        if not isinstance(expression, str):  # what tau-bench's eval() says about e.g. a list
            raise TypeError("eval() arg 1 must be a string, bytes or code object")
        tree = compile(expression, "<string>", "eval", ast.PyCF_ONLY_AST)
        return str(round(float(_evaluate(tree.body)), 2))
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
