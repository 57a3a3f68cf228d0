"""tau-bench's `calculate` arithmetic: Python's semantics over the characters it allows, within fixed budgets.

tau-bench runs `eval(expression)` on strings made of `0123456789+-*/(). `. Here the expression is parsed by
Python's own parser (so syntax errors, the 4,300-digit literal limit and the nesting limits read exactly as
tau-bench's) and the tree is walked without recursion, applying Python's operators to Python's numbers (so results
and error texts are the same). What `eval` does not bound is bounded here, so that no expression can stall a
rollout worker:

* the expression length (`MAX_CHARS`): parsing costs about 1 ms per 1,000 characters;
* the size of every integer the evaluation produces (`MAX_INT_BITS`): a larger one cannot become the float the tool
  returns unless a later division or subtraction shrinks it again, which only exotic expressions do;
* the total big-integer work (`WORK_BUDGET`, counted in 64-bit word operations from the operand sizes, plus one per
  node), so that many large multiplications cannot add up either.

Over a size or work budget the evaluation fails with `OverflowError("int too large to convert to float")`, the
error tau-bench gives for almost every such expression (its final `float()` fails).
"""

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALLOWED_CHARS = "0123456789+-*/(). "  # a string, as in tau-bench: `"12" in ALLOWED_CHARS` is a substring test
MAX_CHARS = 10_000
MAX_INT_BITS = 1 << 16
WORK_BUDGET = 1 << 23
TOO_LARGE = "int too large to convert to float"

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExpressionTooLongError(ValueError):
    """An expression over `MAX_CHARS` characters (not parsed)."""


@dataclass
class Budget:
    """Work allowance of one evaluation; `spent` never exceeds `limit` (the step that would is refused)."""

    limit: int = WORK_BUDGET
    spent: int = 0

    def charge(self, units: int) -> None:
        if self.spent + units > self.limit:
            raise OverflowError(TOO_LARGE)
        self.spent += units


def parse(expression: str) -> ast.expr:
    """The expression's syntax tree, as `eval` parses it (leading spaces dropped, as `eval` does for strings)."""
    if len(expression) > MAX_CHARS:
        raise ExpressionTooLongError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = compile(expression.lstrip(" \t"), "<string>", "eval", ast.PyCF_ONLY_AST)
    except RecursionError as e:  # eval fails at the same depth, while compiling
        raise RecursionError("maximum recursion depth exceeded during compilation") from e
    assert isinstance(tree, ast.Expression)  # mode "eval"
    return tree.body


def evaluate(expression: str, budget: Budget | None = None) -> Any:
    """Python's value of `expression`, or the exception `eval` would raise (or OverflowError over a budget)."""
    budget = budget if budget is not None else Budget()
    return _walk(parse(expression), budget)


def _words(value: Any) -> int:
    return value.bit_length() // 64 + 1 if isinstance(value, int) else 1


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise OverflowError(TOO_LARGE)
    return value


def _binary(op: type, left: Any, right: Any, budget: Budget) -> Any:
    a, b = _words(left), _words(right)
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and right * (left.bit_length() - 1) > MAX_INT_BITS:
            raise OverflowError(TOO_LARGE)  # the result would be at least this large
        result_words = int(right * math.log2(abs(left))) // 64 + 1 if abs(left) > 1 else 1
        budget.charge(result_words * result_words + right.bit_length())  # the squarings, then the exponent bits
    elif op in (ast.Add, ast.Sub):
        budget.charge(a + b)
    else:
        budget.charge(a * b)
    return _check_size(_BINARY[op](left, right))


def _walk(root: ast.expr, budget: Budget) -> Any:
    """Post-order evaluation with an explicit stack: any nesting depth the parser accepts is fine."""
    values: list[Any] = []
    stack: list[tuple[ast.AST, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        budget.charge(1)
        if isinstance(node, ast.Constant):
            values.append(node.value)
            continue
        children = _children(node)
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children))
            continue
        args = values[len(values) - len(children) :] if children else []
        del values[len(values) - len(children) :]
        values.append(_apply(node, args, budget))
    return values[0]


def _children(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    if isinstance(node, ast.UnaryOp):
        return [node.operand]
    if isinstance(node, ast.Tuple):
        return list(node.elts)
    if isinstance(node, ast.Call):  # Python evaluates the callee, the arguments, then fails to call
        args = [a.value if isinstance(a, ast.Starred) else a for a in node.args]
        return [node.func, *args, *(kw.value for kw in node.keywords)]
    raise TypeError(f"unsupported expression: {type(node).__name__}")


def _apply(node: ast.AST, args: list[Any], budget: Budget) -> Any:
    if isinstance(node, ast.BinOp):
        return _binary(type(node.op), args[0], args[1], budget)
    if isinstance(node, ast.UnaryOp):
        budget.charge(_words(args[0]))
        return _UNARY[type(node.op)](args[0])
    if isinstance(node, ast.Tuple):
        return tuple(args)
    assert isinstance(node, ast.Call)
    callee, rest = args[0], args[1:]
    for arg, value in zip(node.args, rest, strict=False):
        if isinstance(arg, ast.Starred) and not isinstance(value, tuple):  # a tuple is the only iterable here
            raise TypeError(f"{callee} argument after * must be an iterable, not {type(value).__name__}")
    if node.keywords:  # no value these characters can form is a mapping
        value = rest[len(node.args)]
        raise TypeError(f"{callee} argument after ** must be a mapping, not {type(value).__name__}")
    raise TypeError(f"'{type(callee).__name__}' object is not callable")
