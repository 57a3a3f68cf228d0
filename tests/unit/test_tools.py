"""The tool bridge: interact_with_env calls, domain tool calls and plain-text replies mapped to gym actions."""

import json

import pytest

from gyms.base import parse_action
from gyms.tools import INTERACT_TOOL, ToolCallError, text_to_action, tool_call_to_action

RETAIL_TOOLS = [{"type": "function", "function": {"name": "get_order_details", "parameters": {}}}]


def test_schema_is_userrls() -> None:
    fn = INTERACT_TOOL["function"]
    assert fn["name"] == "interact_with_env"
    assert fn["parameters"]["required"] == ["choice", "content"]
    assert fn["parameters"]["properties"]["choice"]["enum"] == ["action", "answer", "search"]
    assert set(fn["parameters"]["properties"]) == {"choice", "content"}


@pytest.mark.parametrize(
    ("arguments", "action"),
    [
        ({"choice": "action", "content": "1 2 3 4"}, "[action] 1 2 3 4"),
        ('{"choice": "answer", "content": "42"}', "[answer] 42"),
        ({"choice": "search", "content": "test"}, "[search] test"),
        ({"choice": "answer", "content": "[answer] 7"}, "[answer] 7"),  # no doubled tag
        ({"choice": "finish", "content": "bye"}, "[finish]"),
        ({"choice": "other", "content": "raw text"}, "raw text"),
        ({"choice": "answer"}, "[answer] "),
        # UserRL's InteractTool reads both fields with str(): only the exact spellings are tags ...
        ({"choice": "Answer", "content": "7"}, "7"),
        ({"choice": " answer", "content": "7"}, "7"),
        ({"choice": "FINISH", "content": "bye"}, "bye"),
        ({"content": "[search] q"}, "[search] q"),
        # ... and a non-string content is its Python text
        ({"choice": "answer", "content": {"name": "x"}}, "[answer] {'name': 'x'}"),
        ({"choice": "answer", "content": 42}, "[answer] 42"),
        ({"choice": "answer", "content": True}, "[answer] True"),
        ({"choice": "answer", "content": None}, "[answer] None"),
        ({"choice": "action", "content": ["a", 1]}, "[action] ['a', 1]"),
    ],
)
def test_interact_calls_map_to_actions(arguments: object, action: str) -> None:
    assert tool_call_to_action("interact_with_env", arguments) == action


def test_respond_is_a_tau_domain_tool_call() -> None:
    """tau-bench's `respond` (a message to the user) reaches the tau domain gyms as a tool call they read."""
    action = tool_call_to_action("respond", '{"content": "Your refund is $8,276.23."}', RETAIL_TOOLS)
    assert action == '[answer] {"name": "respond", "arguments": {"content": "Your refund is $8,276.23."}}'
    with pytest.raises(ToolCallError, match="unknown tool 'respond'; available: interact_with_env"):
        tool_call_to_action("respond", '{"content": "hi"}', [INTERACT_TOOL])  # UserRL gyms have no respond
    with pytest.raises(ToolCallError, match="unknown tool 'respond'; available: none"):
        tool_call_to_action("respond", '{"content": "hi"}', [])


def test_hostile_arguments_are_tool_call_errors() -> None:
    """Nesting deeper than the JSON reader goes, or a number over Python's digit limit, is a ToolCallError."""
    deep = '{"choice": "answer", "content": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ToolCallError, match=r"^tool arguments are not valid JSON: maximum recursion depth exceeded"):
        tool_call_to_action("interact_with_env", deep)
    digits = '{"order_id": ' + "9" * 5000 + "}"
    with pytest.raises(ToolCallError, match=r"^tool arguments are not valid JSON: Exceeds the limit \(4300 digits\)"):
        tool_call_to_action("get_order_details", digits, RETAIL_TOOLS)
    nested: dict = {}
    for _ in range(100_000):  # an already parsed value too deep to write out
        nested = {"a": nested}
    with pytest.raises(ToolCallError, match=r"^tool arguments cannot be written out: maximum recursion depth"):
        tool_call_to_action("interact_with_env", {"choice": "answer", "content": nested})
    with pytest.raises(ToolCallError, match=r"^tool arguments cannot be written out: maximum recursion depth"):
        tool_call_to_action("get_order_details", {"order_id": nested}, RETAIL_TOOLS)


def test_domain_tools_become_answer_json() -> None:
    action = tool_call_to_action("get_order_details", '{"order_id": "#W1"}', RETAIL_TOOLS)
    tag, payload = parse_action(action)
    assert tag == "answer" and json.loads(payload) == {"name": "get_order_details", "arguments": {"order_id": "#W1"}}


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("interact_with_env", "{not json", "tool arguments are not valid JSON"),
        ("interact_with_env", "[1, 2]", "tool arguments must be a JSON object, got list"),
        ("cancel_order", "{}", "unknown tool 'cancel_order'; available: get_order_details"),
    ],
)
def test_bad_tool_calls(name: str, arguments: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        tool_call_to_action(name, arguments, RETAIL_TOOLS)


@pytest.mark.parametrize(
    ("text", "mode", "action"),
    [
        ("<think>try 4</think>\n[answer] 4", "end", "[answer] 4"),
        ("I will probe.\n[action] 1 2 3 4\nthen wait", "end", "[action] 1 2 3 4\nthen wait"),
        ("[search] test\n[answer] 5", "end", "[search] test"),  # one action per reply: the first
        ("  [FINISH]", "end", "[FINISH]"),
        ("What is your budget?", "end", None),  # UserRL: a plain reply ends the episode
        ("What is your budget?", "action", "[action] What is your budget?"),
        ("<think>only thinking</think>", "action", None),
        ("see [answer] 4 inline", "end", None),  # tags count only at the start of a line
        ("<think>a</think>b<THINK>c</Think>\n[answer] 1", "end", "[answer] 1"),
        ("<think>" * 3 + "x</think>[answer] 2", "end", "[answer] 2"),  # one block, from the first tag
    ],
)
def test_plain_text_replies(text: str, mode: str, action: str | None) -> None:
    assert text_to_action(text, mode) == action
    if action is not None:
        assert parse_action(action)[0] in ("action", "answer", "search", "finish")


def test_many_unclosed_think_tags_cost_one_pass() -> None:
    """Thinking blocks are removed in one pass: 200,000 unclosed `<think>` tags are just text (the non-greedy
    regex used before rescanned the rest of the text from each of them: quadratic)."""
    from gyms.reply_json import strip_think

    text = "<think>" * 200_000 + "\n[answer] 3"
    assert text_to_action(text, "end") == "[answer] 3"
    assert strip_think("x<think>a</think>y<think>b") == "xy<think>b"
    assert strip_think("İ<think>a</think>b</think>c") == "c"  # positions from the text itself, not its lower()


def test_unknown_reply_mode() -> None:
    with pytest.raises(ValueError, match="reply_without_tool_call must be one of end, action, got 'ignore'"):
        text_to_action("hi", "ignore")


def test_parse_action() -> None:
    assert parse_action("  [Answer]  42 ") == ("answer", "42")
    assert parse_action("[finish]") == ("finish", "")
    assert parse_action("hello [answer] 3") == (None, "hello [answer] 3")
