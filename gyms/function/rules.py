"""FunctionGym's hidden rules: a safe evaluator, and a seeded generator with a difficulty knob.

A rule is an arithmetic expression over the inputs a, b, c, d with + - * / ** and parentheses, e.g.
`(c + b) ** 2 - a + d`. Rules are evaluated by walking their syntax tree (never `eval`) with Python's operators:
on float inputs (the gym's probes, as in UserRL) with float semantics (an overflowing power raises, `inf` and `nan`
pass through as in UserRL); on integer inputs (the generator) exactly, with integer powers bounded by
`MAX_POWER_BITS`.
"""

import ast
import math
import operator
import random
from collections.abc import Callable, Sequence
from typing import Any

from gyms.function.settings import FunctionGeneratorConfig

Number = int | float
VARIABLES = ("a", "b", "c", "d")
MAX_POWER_BITS = 4096  # a power whose result needs more bits than this is refused as an overflow
MAX_EXPECTED = 10**6
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class Rule:
    """A parsed rule; `rule(numbers)` evaluates it on [a, b, c, d]."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._tree = ast.parse(text, mode="eval").body
        _check(self._tree, text)

    def __call__(self, numbers: Sequence[Number]) -> Number:
        """The rule's value; ZeroDivisionError / OverflowError / ValueError on inputs it cannot handle."""
        return _evaluate(self._tree, dict(zip(VARIABLES, numbers, strict=True)))


def _check(node: ast.AST, text: str) -> None:
    ok = (
        (isinstance(node, ast.BinOp) and type(node.op) in _BINARY)
        or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd))
        or (isinstance(node, ast.Name) and node.id in VARIABLES)
        or (isinstance(node, ast.Constant) and type(node.value) in (int, float))
    )
    if not ok:
        raise ValueError(f"rule {text!r}: only a, b, c, d, numbers, + - * / ** and parentheses are allowed")
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.operator | ast.unaryop | ast.expr_context):
            _check(child, text)


def _evaluate(node: ast.AST, env: dict[str, Number]) -> Number:
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # the rules' syntax tree is checked when parsed
        return node.value
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else value
    assert isinstance(node, ast.BinOp)
    left, right = _evaluate(node.left, env), _evaluate(node.right, env)
    if (
        isinstance(node.op, ast.Pow)
        and isinstance(left, int)
        and isinstance(right, int)
        and abs(left) > 1
        and abs(right) * math.log2(abs(left)) > MAX_POWER_BITS
    ):
        raise OverflowError("power too large")
    value = _BINARY[type(node.op)](left, right)
    if isinstance(value, complex):
        raise ValueError("complex result")
    return value


def generate_function(cfg: FunctionGeneratorConfig, split: str, index: int) -> dict[str, Any]:
    """Procedural task `index` of `split`: a record like functions.json's, with an integral expected result.

    The stream is seeded by (seed, split, index), so a task id always maps to the same rule and test case.
    """
    if cfg.balanced and cfg.max_input < len(VARIABLES):
        raise ValueError(f"balanced FunctionGym tasks need distinct inputs: max_input >= 4, not {cfg.max_input}")
    rng = random.Random(f"function:{cfg.seed}:{split}:{index}")
    first = VARIABLES[index % len(VARIABLES)] if cfg.balanced else None
    for _ in range(10_000):  # rejection sampling; sensible settings accept a draw within a few tries
        rule = Rule(random_rule(rng, cfg.terms, cfg.operators, first))
        if cfg.balanced:
            test_case = rng.sample(range(1, cfg.max_input + 1), len(VARIABLES))
        else:
            test_case = [rng.randint(1, cfg.max_input) for _ in VARIABLES]
        try:
            value = rule(test_case)
            integral = abs(value) <= MAX_EXPECTED and float(value).is_integer()
        except (ArithmeticError, ValueError):
            continue
        if integral:
            return {
                "id": f"fgen-{split}-{cfg.seed}-{index}",
                "rule": rule.text,
                "test_case": test_case,
                "expected_result": float(value),
            }
    raise ValueError(f"no rule with an integral result found for {cfg}; allow more operators or larger inputs")


def random_rule(rng: random.Random, terms: int, operators: list[str], first: str | None = None) -> str:
    """A random rule over `terms` distinct inputs, joined by the binary operators in `operators`; `first`, when
    given, is the leftmost input.

    `**` in `operators` squares a term or a parenthesised sub-expression one time in five.
    """
    binary = [op for op in operators if op != "**"]
    square = "**" in operators
    if first is None:
        names = rng.sample(VARIABLES, terms)
    else:
        names = [first, *rng.sample([v for v in VARIABLES if v != first], terms - 1)]

    def build(items: list[str]) -> tuple[str, str | None]:  # (text, top-level operator or None)
        if len(items) == 1:
            text, top = items[0], None
        else:
            cut = rng.randint(1, len(items) - 1)
            op = rng.choice(binary)
            (left, left_op), (right, right_op) = build(items[:cut]), build(items[cut:])
            if left_op is not None and _PRECEDENCE[left_op] < _PRECEDENCE[op]:
                left = f"({left})"
            if right_op is not None and (
                _PRECEDENCE[right_op] < _PRECEDENCE[op] or (_PRECEDENCE[right_op] == _PRECEDENCE[op] and op in "-/")
            ):
                right = f"({right})"
            text, top = f"{left} {op} {right}", op
        if square and rng.random() < 0.2:
            return (f"({text}) ** 2" if top else f"{text} ** 2"), None
        return text, top

    return build(names)[0]
