"""Rules for settings values, and the one message format of each: a numeric range (`Rule`) or a set of choices.

The central tables (`config/ranges.py` `RANGES`, `config/checks.py` `CHOICES`) apply them to the core sections; a
gym's settings dataclass carries its own in its `RANGES` and `CHOICES` class attributes (`config/gyms.py`,
`settings_problems`)."""

from collections.abc import Callable

Rule = tuple[str, Callable[[float], bool]]

COUNT: Rule = (">= 1", lambda v: v >= 1)
NON_NEGATIVE: Rule = (">= 0", lambda v: v >= 0)
POSITIVE: Rule = ("> 0", lambda v: v > 0)
PROBABILITY: Rule = ("in [0, 1]", lambda v: 0 <= v <= 1)
OPEN_PROBABILITY: Rule = ("in (0, 1]", lambda v: 0 < v <= 1)
BETA: Rule = ("in [0, 1)", lambda v: 0 <= v < 1)
TOP_K: Rule = ("-1 (disabled) or >= 1", lambda v: v == -1 or v >= 1)
AUTO_OR_NON_NEGATIVE: Rule = ("-1 (auto) or >= 0", lambda v: v == -1 or v >= 0)
YAML_ON_OFF = {"True": "on", "False": "off"}  # a bare on/off in YAML is a boolean, which a str field reads so


def range_problem(dotted: str, value: float, rule: Rule) -> str:
    """`<dotted> must be <range>, got <value>`, or "" when `value` is inside the rule's range."""
    text, ok = rule
    return "" if ok(value) else f"{dotted} must be {text}, got {value}"


def choice_problem(dotted: str, value: object, allowed: tuple[str, ...]) -> str:
    """`<dotted> = <value>; choose from <allowed>`, or "" when `value` is one of them (a YAML on/off read as on/off)."""
    if "on" in allowed and isinstance(value, str):
        value = YAML_ON_OFF.get(value, value)
    return "" if value in allowed else f"{dotted} = {value!r}; choose from {', '.join(allowed)}"
