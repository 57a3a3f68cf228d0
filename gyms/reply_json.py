"""Reading a JSON object out of an LLM reply: thinking blocks, code fences, Python literals, trailing prose."""

import ast
import json
import re
from typing import Any

_THINK_TAG = re.compile(r"<(/?)think>", re.IGNORECASE)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)```", re.DOTALL)
_PY_LITERALS = {"true": "True", "false": "False", "null": "None"}
SCAN_BUDGET = 32  # brace scans may read the reply this many times over in all (a normal reply needs one or two)


def strip_think(text: str) -> str:
    """Remove `<think>…</think>` blocks, and an unterminated leading `<think>` block's opening (Qwen3).

    One left-to-right pass (what a non-greedy `<think>.*?</think>` substitution does, without its quadratic
    rescans of text holding many unclosed `<think>` tags).
    """
    tags = [(m.start(), m.end(), bool(m.group(1))) for m in _THINK_TAG.finditer(text)]
    kept, pos, i = [], 0, 0
    while True:
        while i < len(tags) and (tags[i][2] or tags[i][0] < pos):  # the next opening tag at or after pos
            i += 1
        j = i + 1
        while j < len(tags) and not tags[j][2]:  # the first closing tag after it
            j += 1
        if i >= len(tags) or j >= len(tags):
            break
        kept.append(text[pos : tags[i][0]])
        pos, i = tags[j][1], j + 1
    kept.append(text[pos:])
    text = "".join(kept)
    closings = [m for m in _THINK_TAG.finditer(text) if m.group(1)]
    if closings:  # the opening tag was in the prompt (thinking forced on): keep the answer part
        text = text[closings[-1].end() :]
    return text.strip()


def extract_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text`, or None.

    Tries, in order: the whole text; each fenced block; each `{` position decoded up to its matching brace
    (so prose before or after the object is ignored). Each candidate is read as JSON first, then as a Python
    literal (single quotes, True/False/None), so both `true` and `True` work. Control characters inside strings
    are kept: xgrammar's grammar for a string with `maxLength` (`[^"\\\r\n]{0,N}`, 0.2.7) lets a constrained
    reply hold a raw tab or other control character, which strict JSON refuses.
    """
    text = strip_think(text)
    candidates = [text, *(m.group(1) for m in _FENCE.finditer(text))]
    for candidate in candidates:
        obj = _as_object(candidate.strip())
        if obj is not None:
            return obj
    budget = [SCAN_BUDGET * (len(text) + 1)]  # characters the brace scans may read, over all `{` positions
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        obj = _object_at(text, start, budget)
        if obj is not None:
            return obj
        if budget[0] <= 0:  # a reply made of thousands of unbalanced braces: give up rather than go quadratic
            return None
    return None


def _as_object(candidate: str) -> dict[str, Any] | None:
    if not candidate.startswith("{"):
        return None
    try:
        obj = json.loads(candidate, strict=False)
    except (ValueError, RecursionError):  # malformed, nested deeper than the reader goes, or digits over the limit
        obj = _python_literal(candidate)
    return obj if isinstance(obj, dict) else None


def _object_at(text: str, start: int, budget: list[int]) -> dict[str, Any] | None:
    try:
        obj, _ = json.JSONDecoder(strict=False).raw_decode(text, start)
        return obj if isinstance(obj, dict) else None
    except (ValueError, RecursionError):
        end = _matching_brace(text, start, budget)
        if end is None:
            return None
        budget[0] -= end + 1 - start
        return _python_literal(text[start : end + 1])


def _matching_brace(text: str, start: int, budget: list[int]) -> int | None:
    stop = min(len(text), start + max(budget[0], 0))
    depth, quote, escaped = 0, "", False
    for i in range(start, stop):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                budget[0] -= i + 1 - start
                return i
    budget[0] -= stop - start
    return None


def _python_literal(candidate: str) -> dict[str, Any] | None:
    fixed = re.sub(r"\b(true|false|null)\b", lambda m: _PY_LITERALS[m.group(1)], candidate)
    try:
        obj = ast.literal_eval(fixed)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # TypeError: `{[1]: 2}`
        return None
    return obj if isinstance(obj, dict) else None
