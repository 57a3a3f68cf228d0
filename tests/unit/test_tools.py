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
        ({"choice": "Answer", "content": "[answer] 7"}, "[answer] 7"),  # no doubled tag
        ({"choice": "finish", "content": "bye"}, "[finish]"),
        ({"choice": "other", "content": "raw text"}, "raw text"),
        ({"choice": "answer", "content": {"name": "x"}}, '[answer] {"name": "x"}'),
        ({"choice": "answer"}, "[answer] "),
    ],
)
def test_interact_calls_map_to_actions(arguments: object, action: str) -> None:
    assert tool_call_to_action("interact_with_env", arguments) == action


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
    ],
)
def test_plain_text_replies(text: str, mode: str, action: str | None) -> None:
    assert text_to_action(text, mode) == action
    if action is not None:
        assert parse_action(action)[0] in ("action", "answer", "search", "finish")


def test_unknown_reply_mode() -> None:
    with pytest.raises(ValueError, match="reply_without_tool_call must be one of end, action, got 'ignore'"):
        text_to_action("hi", "ignore")


def test_parse_action() -> None:
    assert parse_action("  [Answer]  42 ") == ("answer", "42")
    assert parse_action("[finish]") == ("finish", "")
    assert parse_action("hello [answer] 3") == (None, "hello [answer] 3")
