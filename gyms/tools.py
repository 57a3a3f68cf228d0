"""The tool bridge: UserRL's single `interact_with_env(choice, content)` function tool mapped to gym actions.

The schema is UserRL's, verbatim, so prompts, data and evaluation stay compatible. Models without tool
calling write the same actions as plain tags (`[action] ...`); `tool_call_to_action` and `parse_action`
(gyms.base) meet at the same action strings.
"""

import json
import re
from typing import Any

INTERACT_TOOL_NAME = "interact_with_env"

INTERACT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": INTERACT_TOOL_NAME,
        "description": (
            "A tool for interact with a target environment. The detailed environment description and action space "
            "is provided in the system prompt, so please follow the system prompt when calling this tool. You can "
            "use this tool to interact with the target environment step by step."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "choice": {
                    "type": "string",
                    "enum": ["action", "answer", "search"],
                    "description": (
                        "Your choice of what to do next, must be one of `action`, `answer` or `search`. Please "
                        "follow system prompt about the scope of choices you can make and how to decide your choice."
                    ),
                },
                "content": {
                    "type": "string",
                    "description": (
                        "The content of your choice, must be a string. If you choose `action`, you should provide "
                        "the action you want to take. If you choose `answer`, you should provide the answer that you "
                        "want to submit. If you choose `search`, you should provide the search query. The specific "
                        "format of the content is determined by the environment description in the system prompt. "
                        "Please follow the format strictly in order to successfully use this tool."
                    ),
                },
            },
            "required": ["choice", "content"],
        },
    },
}

TAG_FORMAT_INSTRUCTIONS = (
    "Reply with exactly one action on its own line, written as a tag followed by its content: "
    "`[action] <content>`, `[answer] <content>` or `[search] <content>` (or `[finish]` to stop)."
)


# Task.metadata["reply_without_tool_call"]: what a reply without a tool call means. "end": the episode ends (UserRL,
# the default); "action": the text is sent to the gym as "[action] <text>".
REPLY_WITHOUT_TOOL_CALL = ("end", "action")
_TAG_LINE = re.compile(r"^[ \t]*\[(?:action|answer|search|finish)\]", re.IGNORECASE | re.MULTILINE)


RESPOND_TOOL = "respond"  # tau-bench's action name for a message to the user


class ToolCallError(ValueError):
    """A tool call that cannot be mapped to a gym action (wrong tool, bad arguments)."""


def tool_call_to_action(name: str, arguments: str | dict[str, Any], tools: list[dict[str, Any]] | None = None) -> str:
    """Map a parsed tool call to the gym action string.

    `interact_with_env` follows UserRL's InteractTool exactly: `choice` and `content` are read with `str()`
    (a non-string content becomes its Python text, `{'a': 1}`), choice `action`/`answer`/`search` (spelled
    exactly so) gives "[choice] content" unless the content already starts with that tag, `finish` gives
    "[finish]", and any other choice (`Answer`, ` answer`, none) passes the content on untagged. A call of a domain
    tool listed in `tools` (tau-bench style) becomes `[answer] {"name": name, "arguments": {...}}`; so does
    `respond`, tau-bench's message to the user, whenever `tools` are domain tools (the tau gyms read it as one).
    """
    args = _decode_arguments(arguments)
    known = {t.get("function", {}).get("name") for t in tools or []}
    try:
        if name == INTERACT_TOOL_NAME:
            choice, content = str(args.get("choice", "")), str(args.get("content", ""))
            if choice == "finish":
                return "[finish]"
            if choice in ("action", "answer", "search"):
                tag = f"[{choice}]"
                return content if content.startswith(tag) else f"{tag} {content}"
            return content
        if name in known or (name == RESPOND_TOOL and known and INTERACT_TOOL_NAME not in known):
            return "[answer] " + json.dumps({"name": name, "arguments": args})
    except (ValueError, RecursionError) as e:  # a value too deep to write out, or an int over the digit limit
        raise ToolCallError(f"tool arguments cannot be written out: {str(e)[:200]}") from e
    raise ToolCallError(f"unknown tool {name!r}; available: {', '.join(sorted(n for n in known if n)) or 'none'}")


def _decode_arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:  # malformed, too deeply nested, or a number over the digit limit
            raise ToolCallError(f"tool arguments are not valid JSON: {str(e)[:200]}") from e
    if not isinstance(arguments, dict):
        raise ToolCallError(f"tool arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


def text_to_action(text: str, reply_without_tool_call: str = "end") -> str | None:
    """The gym action of a reply that has no tool call, or None when the episode should end.

    A line starting with a tag (`[answer] 42`, the plain tag form for models without tool calling) is the action,
    up to the next tagged line; thinking blocks are ignored. Without a tag the text becomes `[action] <text>` if
    `reply_without_tool_call` is "action", and ends the episode if it is "end".
    """
    from gyms.reply_json import strip_think

    if reply_without_tool_call not in REPLY_WITHOUT_TOOL_CALL:
        modes = ", ".join(REPLY_WITHOUT_TOOL_CALL)
        raise ValueError(f"reply_without_tool_call must be one of {modes}, got {reply_without_tool_call!r}")
    body = strip_think(text)
    tags = list(_TAG_LINE.finditer(body))
    if tags:
        end = tags[1].start() if len(tags) > 1 else len(body)
        return body[tags[0].start() : end].strip()
    if reply_without_tool_call == "action" and body:
        return f"[action] {body}"
    return None
