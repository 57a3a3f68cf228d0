"""Chat in token space: a model's chat template applied incrementally to a running list of token ids.

The policy's own tokens are never re-rendered or re-tokenised. After each generation only two things are
appended, both untrained: the rest of the template's end-of-turn suffix (for ChatML templates the `\\n`
after `<|im_end|>`, the turn separator that "render only the new messages" delta schemes drop), and the
environment's reply messages followed by the next generation prompt. Both deltas are cut from renders of a
fixed probe conversation, so the ids built here equal `apply_chat_template` of the whole conversation
(tests prove it for Qwen3 and SmolLM2) wherever the template does not rewrite earlier turns (docs/rollout.md);
a template that cannot be applied this way raises `ChatTemplateError`.

Also here: how tools are presented to the policy per `model.tool_format`, and the parser of Hermes / Qwen
`<tool_call>{json}</tool_call>` blocks (plain `[action] ...` tag lines are read by `gyms.tools.text_to_action`).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyms.tools import TAG_FORMAT_INSTRUCTIONS, ToolCallError, tool_call_to_action
from userrl_megatron.types import Message

TOOL_FORMATS = ("auto", "hermes", "tags")

# Probe conversation the deltas are cut from. Its assistant message ends with a marker and is tried plain and
# with a reasoning block: thinking templates (Qwen3) render the latest assistant turn with `<think>` and earlier
# ones without, unless the content carries reasoning, which they then keep wherever the turn sits.
_PROBE = [Message("system", "S"), Message("user", "U")]
_MARKER = "PROBE-7f3a"
_PROBE_ASSISTANT = (_MARKER, f"<think>\nR\n</think>\n\n{_MARKER}")
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "D",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}


class ChatTemplateError(ValueError):
    """The model's chat template cannot be applied incrementally (or cannot present tools)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed function call: the tool's name and its arguments as written by the model."""

    name: str
    arguments: dict[str, Any] | str


class ChatTemplate:
    """Incremental chat-template rendering in token space for one tokenizer and one tool format."""

    def __init__(self, tokenizer: Any, tool_format: str = "auto") -> None:
        """`tool_format` "auto" becomes "hermes" when the template presents tool schemas and asks for
        `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes), else "tags"; `self.tool_format` is always the resolved one."""
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"model.tool_format = {tool_format!r}; choose from {', '.join(TOOL_FORMATS)}")
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        self.tokenizer = tokenizer
        self._suffix_cache: dict[str, str] = {}
        if tool_format == "auto":
            tool_format = "hermes" if self.presents_hermes_tools() else "tags"
        self.tool_format = tool_format

    @classmethod
    def from_pretrained(cls, path: str | Path, tool_format: str = "auto") -> "ChatTemplate":
        """The chat template of the tokenizer saved in the model directory `path`."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), tool_format)

    # ---- rendering -------------------------------------------------------------------------------------------

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *, generation: bool) -> str:
        """The template's text for `messages` (with the generation prompt when `generation`)."""
        return self.tokenizer.apply_chat_template(
            [m.to_dict() for m in messages], tools=tools or None, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text; special tokens written in it are parsed, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ---- tools -----------------------------------------------------------------------------------------------

    def presents_hermes_tools(self) -> bool:
        """Whether the template writes tool schemas into the prompt and asks for `<tool_call>` blocks."""
        with_tools = self.render(_PROBE, [_PROBE_TOOL], generation=True)
        return with_tools != self.render(_PROBE, None, generation=True) and "<tool_call>" in with_tools

    def present(
        self, messages: list[Message], tools: list[dict[str, Any]]
    ) -> tuple[list[Message], list[dict[str, Any]] | None]:
        """The prompt messages and template tools that show `tools` to the policy in this tool format.

        hermes: the schemas go to the template (Qwen3 writes them into a "# Tools" system block); a template
        that ignores them is an error, since the policy would never see its tools. tags: no schemas; the
        system message gains `TAG_FORMAT_INSTRUCTIONS` (one is created when the prompt has none), an earlier
        assistant tool call becomes its action lines and a tool result the user's turn, as the runner writes
        them in this format.
        """
        if not tools:
            return messages, None
        if self.tool_format == "tags":
            messages = [self._in_tags(m, tools) for m in messages]
        if self.tool_format == "hermes":
            if self.render(messages, tools, generation=True) == self.render(messages, None, generation=True):
                raise ChatTemplateError(
                    f"the chat template of {self.tokenizer.name_or_path!r} ignores tools, so the policy would never "
                    "see them; set model.tool_format=tags"
                )
            return messages, tools
        if messages and messages[0].role == "system":
            system = Message("system", f"{messages[0].content}\n\n{TAG_FORMAT_INSTRUCTIONS}")
            return [system, *messages[1:]], None
        return [Message("system", TAG_FORMAT_INSTRUCTIONS), *messages], None

    # ---- incremental token ids -------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of the initial prompt, ending with the generation prompt."""
        return self.encode(self.render(messages, tools, generation=True))

    def turn_suffix_ids(self, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids the template writes after an assistant message's content (ChatML: `<|im_end|>`, `\\n`)."""
        return self.encode(self._turn_suffix(tools))

    def _turn_suffix(self, tools: list[dict[str, Any]] | None) -> str:
        key = json.dumps(tools, sort_keys=True) if tools else ""
        if key not in self._suffix_cache:
            head = self.render(_PROBE, tools, generation=True)
            for content in _PROBE_ASSISTANT:
                full = self.render([*_PROBE, Message("assistant", content)], tools, generation=False)
                if full.startswith(head + content):
                    self._suffix_cache[key] = full[len(head + content) :]
                    break
            else:
                raise ChatTemplateError(
                    f"the chat template of {self.tokenizer.name_or_path!r} does not render an assistant message as "
                    "generation prompt + content + suffix; it cannot be applied in token space"
                )
        return self._suffix_cache[key]

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end an assistant turn: the first token of the turn suffix, and the tokenizer's EOS."""
        ids = self.turn_suffix_ids()[:1]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids

    def close_turn_ids(self, generated: list[int], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The untrained ids that complete an assistant turn that ended on a stop token.

        When the generation ended with the suffix's own first token (`<|im_end|>`), only the rest (the turn
        separator) is added; after any other stop token (e.g. Qwen's `<|endoftext|>`) the whole suffix is.
        """
        suffix = self.turn_suffix_ids(tools)
        if generated and suffix and generated[-1] == suffix[0]:
            return suffix[1:]
        return list(suffix)

    def reply_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of environment messages (tool or user) after a closed assistant turn, plus the generation prompt.

        Cut from a render of the probe conversation + these messages, right after the probe assistant turn's
        suffix: what the template writes for them there, whatever it does to the turns before (Qwen3 drops the
        reasoning of assistant turns that precede a user message; the policy's own tokens keep it).
        """
        anchor = _MARKER + self._turn_suffix(tools)
        for content in _PROBE_ASSISTANT:
            text = self.render([*_PROBE, Message("assistant", content), *messages], tools, generation=True)
            at = text.find(anchor)
            if at >= 0:
                return self.encode(text[at + len(anchor) :])
        raise ChatTemplateError(
            f"the chat template of {self.tokenizer.name_or_path!r} does not close an assistant turn the same way when "
            f"{', '.join(m.role for m in messages)} messages follow it; it cannot be applied in token space"
        )

    # ---- assistant messages written by someone else (SFT data) -----------------------------------------------

    def assistant_text(self, message: Message, tools: list[dict[str, Any]] | None = None) -> str:
        """The text a policy would generate for an OpenAI-style assistant `message` in this tool format: its
        content, with its `tool_calls` written out. tags: one `[choice] content` action line per call (what the
        gym receives from a Hermes call). hermes: the calls as the template writes them after the content
        (Qwen3: `\n<tool_call>\n{json}\n</tool_call>`), or Hermes blocks when the template ignores them."""
        calls = message.tool_calls or []
        if not calls:
            return message.content
        parsed = [_openai_call(call) for call in calls]
        if self.tool_format == "tags":
            lines = [tool_call_to_action(name, arguments, tools) for name, arguments in parsed]
            return "\n".join([message.content, *lines] if message.content else lines)
        probe = [*_PROBE, Message("assistant", _MARKER, tool_calls=calls), Message("user", "U")]
        text = self.render(probe, tools, generation=False)
        at = text.find(_MARKER) + len(_MARKER)
        written = text[at : text.find(self._turn_suffix(tools), at)]
        if OPEN_CALL not in written:  # the template ignores tool calls: Hermes blocks, as Qwen writes them
            blocks = [
                json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) for name, arguments in parsed
            ]
            written = "".join(f"\n{OPEN_CALL}\n{block}\n{CLOSE_CALL}" for block in blocks)
        return message.content + written if message.content else written.lstrip("\n")

    def _in_tags(self, message: Message, tools: list[dict[str, Any]]) -> Message:
        if message.role == "assistant" and message.tool_calls:
            return Message("assistant", self.assistant_text(message, tools))
        return Message("user", message.content) if message.role == "tool" else message

    # ---- replies -> gym actions ------------------------------------------------------------------------------

    def actions(self, reply: str, tools: list[dict[str, Any]]) -> list[str]:
        """The gym actions of a decoded reply's tool calls, in order ([] under the tags format, or without calls).

        Raises `ToolCallError` for a call that cannot become an action (malformed JSON, unknown tool, bad
        arguments), which ends the episode as `bad_tool_call`. A reply without calls is read by
        `gyms.tools.text_to_action` (tag lines, or the whole text under `reply_without_tool_call: action`).
        """
        if self.tool_format == "tags":
            return []
        return [tool_call_to_action(c.name, c.arguments, tools) for c in parse_hermes_tool_calls(reply)]


OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"


def _openai_call(call: dict[str, Any]) -> tuple[str, dict[str, Any] | str]:
    """(name, arguments) of an OpenAI tool call `{"type": "function", "function": {"name", "arguments"}}`."""
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolCallError(f'a tool call needs "function": {{"name": ..., "arguments": ...}}, got {call!r:.200}')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolCallError(f"tool call {function['name']!r}: arguments are not valid JSON ({e})") from e
    if not isinstance(arguments, dict):
        raise ToolCallError(f"tool call {function['name']!r}: arguments must be a JSON object")
    return function["name"], arguments


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block of `text`, in order.

    Raises `ToolCallError` when a block is not a JSON object with a string `name` (too deep or too long a
    number included), or a `<tool_call>` is never closed. One pass over the text, whatever it holds.
    """
    calls, at = [], 0
    while (start := text.find(OPEN_CALL, at)) >= 0:
        end = text.find(CLOSE_CALL, start + len(OPEN_CALL))
        if end < 0:
            raise ToolCallError("a <tool_call> is not closed by </tool_call>")
        block, at = text[start + len(OPEN_CALL) : end], end + len(CLOSE_CALL)
        if OPEN_CALL in block:
            raise ToolCallError("a <tool_call> is not closed by </tool_call>")
        try:
            payload = json.loads(block)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, the int digit limit, deep nesting
            raise ToolCallError(f"<tool_call> block is not valid JSON ({e}): {block.strip()[:200]!r}") from e
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ToolCallError(
                f'<tool_call> block must be a JSON object with a string "name": {block.strip()[:200]!r}'
            )
        calls.append(ToolCall(payload["name"], payload.get("arguments", {})))
    return calls
