"""The real chat templates the token-space tests use, loaded once per process, and a Hermes tool call writer."""

import functools
import json

from userrl_megatron.model_store import qwen3_tokenizer_dir, resolve_model
from userrl_megatron.rollout.chat import ChatTemplate


@functools.cache
def qwen3_chat() -> ChatTemplate:
    """The real Qwen3 tokenizer and template (tools, reasoning), Hermes tool calls."""
    return ChatTemplate.from_pretrained(qwen3_tokenizer_dir(), "hermes")


@functools.cache
def smollm2_chat() -> ChatTemplate:
    """SmolLM2-135M-Instruct's tokenizer and template (no tools), tag actions."""
    return ChatTemplate.from_pretrained(resolve_model("smollm2-135m-instruct"), "tags")


def interact_call(choice: str, content: str, reasoning: str = "") -> str:
    """A Qwen3-style reply calling `interact_with_env`, after a `<think>` block when `reasoning` is given."""
    args = json.dumps({"choice": choice, "content": content})
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    return f'{think}<tool_call>\n{{"name": "interact_with_env", "arguments": {args}}}\n</tool_call>'
