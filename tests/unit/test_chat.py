"""Chat in token space against the real Qwen3 and SmolLM2 tokenizers, and the reply parsers."""

import copy

import pytest

from gyms.tools import INTERACT_TOOL, TAG_FORMAT_INSTRUCTIONS, ToolCallError
from tests.support.chat_templates import interact_call, qwen3_chat, smollm2_chat
from userrl_megatron.rollout.chat import (
    ChatTemplate,
    ChatTemplateError,
    ToolCall,
    parse_hermes_tool_calls,
)
from userrl_megatron.types import Message

SYSTEM = "You are an agent that interacts with FunctionGym. Guess the hidden mapping function."
USER = "My mapping function is settled and ready. You may begin your guessing and trials now!\n"


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    return qwen3_chat()


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    return smollm2_chat()


def build(chat: ChatTemplate, prompt: list[Message], tools, turns) -> tuple[list[int], list[int], list[Message]]:
    """Run a scripted conversation through the incremental API: `turns` is [(assistant text, reply messages)].

    Each "generation" is the canonical tokenisation of the text followed by the stop token, as an engine would
    return it. Returns (ids, loss mask, messages).
    """
    ids, mask, messages = chat.prompt_ids(prompt, tools), [], list(prompt)
    mask = [0] * len(ids)
    for text, replies in turns:
        generated = chat.encode(text) + chat.stop_token_ids[:1]
        close = chat.close_turn_ids(generated, tools)
        ids += generated + close
        mask += [1] * len(generated) + [0] * len(close)
        messages.append(Message("assistant", text))
        if replies:
            reply = chat.reply_ids(replies, tools)
            ids += reply
            mask += [0] * len(reply)
            messages += replies
    return ids, mask, messages


def full_render_ids(chat: ChatTemplate, messages: list[Message], tools) -> list[int]:
    out = chat.tokenizer.apply_chat_template([m.to_dict() for m in messages], tools=tools, tokenize=True)
    return list(out["input_ids"])


def test_qwen3_tool_episode_equals_full_render(qwen3: ChatTemplate) -> None:
    tools = [INTERACT_TOOL]
    prompt, tools_shown = qwen3.present([Message("system", SYSTEM), Message("user", USER)], tools)
    assert tools_shown == tools
    turns = [
        (
            interact_call("search", "test", reasoning="First the test case."),
            [Message("tool", "Test case: [1, 2, 3, 4]\nReward: 0.0")],
        ),
        (
            interact_call("action", "1 1 1 1", reasoning="Probe twice.") + "\n" + interact_call("action", "2 1 1 1"),
            [
                Message("tool", "For numbers [1, 1, 1, 1], the result is 2.\nReward: 0.0"),
                Message("tool", "For numbers [2, 1, 1, 1], the result is 3.\nReward: 0.0"),
            ],
        ),
        (interact_call("answer", "3", reasoning="It is a + b."), []),
    ]
    ids, mask, messages = build(qwen3, prompt, tools, turns)
    assert ids == full_render_ids(qwen3, messages, tools)
    assert qwen3.decode(ids) == qwen3.render(messages, tools, generation=False)
    # The trained tokens are exactly the three generations, stop tokens included.
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert trained == [t for text, _ in turns for t in [*qwen3.encode(text), 151645]]


def test_qwen3_turn_separator_is_kept_and_untrained(qwen3: ChatTemplate) -> None:
    """The `\\n` after `<|im_end|>` closes each assistant turn; rendering only the new messages drops it."""
    newline = qwen3.encode("\n")
    assert qwen3.turn_suffix_ids() == [151645, *newline]
    assert qwen3.close_turn_ids([10, 151645]) == newline
    generated = [*qwen3.encode(interact_call("search", "test")), 151645]
    tool = Message("tool", "Test case: [1, 2, 3, 4]\nReward: 0.0")
    prompt = [Message("system", SYSTEM), Message("user", USER)]
    full = full_render_ids(
        qwen3, [*prompt, Message("assistant", interact_call("search", "test")), tool], [INTERACT_TOOL]
    )
    start = qwen3.prompt_ids(prompt, [INTERACT_TOOL]) + generated
    naive = start + qwen3.encode(qwen3.render([tool], None, generation=False))
    ours = start + qwen3.close_turn_ids(generated) + qwen3.reply_ids([tool], [INTERACT_TOOL])
    assert naive != full[: len(naive)]
    assert ours == full + qwen3.encode("<|im_start|>assistant\n")


def test_close_after_another_stop_token_appends_whole_suffix(qwen3: ChatTemplate) -> None:
    endoftext = qwen3.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert qwen3.close_turn_ids([10, endoftext]) == qwen3.turn_suffix_ids()
    assert qwen3.stop_token_ids == [151645]


def test_qwen3_user_reply_after_a_reasoning_turn(qwen3: ChatTemplate) -> None:
    """Qwen3 drops earlier reasoning once a user message follows; the reply delta is still exact."""
    reply = qwen3.reply_ids([Message("user", "I want a refund.")])
    assert qwen3.decode(reply) == "<|im_start|>user\nI want a refund.<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_tag_episode_equals_full_render(smollm2: ChatTemplate) -> None:
    prompt, tools_shown = smollm2.present([Message("system", SYSTEM), Message("user", USER)], [INTERACT_TOOL])
    assert tools_shown is None
    assert prompt[0].content == f"{SYSTEM}\n\n{TAG_FORMAT_INSTRUCTIONS}"
    turns = [
        ("Let me get the test case.\n[search] test", [Message("user", "Test case: [1, 2, 3, 4]\nReward: 0.0")]),
        ("[action] 1 1 1 1", [Message("user", "For numbers [1, 1, 1, 1], the result is 2.\nReward: 0.0")]),
        ("[answer] 3", []),
    ]
    ids, mask, messages = build(smollm2, prompt, None, turns)
    assert ids == full_render_ids(smollm2, messages, None)
    assert smollm2.decode(ids) == smollm2.render(messages, None, generation=False)
    assert sum(mask) == sum(len(smollm2.encode(text)) + 1 for text, _ in turns)


def test_tag_format_without_system_message_gets_one(smollm2: ChatTemplate) -> None:
    prompt, _ = smollm2.present([Message("user", USER)], [INTERACT_TOOL])
    assert prompt == [Message("system", TAG_FORMAT_INSTRUCTIONS), Message("user", USER)]
    assert smollm2.present([Message("user", USER)], []) == ([Message("user", USER)], None)


def test_an_earlier_tool_call_in_the_prompt_is_shown_in_the_tool_format(
    qwen3: ChatTemplate, smollm2: ChatTemplate
) -> None:
    """A prompt that continues a conversation (tau2's message histories): under tags, the agent's earlier call is
    its action line and the result the user's turn, as the runner writes them; hermes templates render both."""
    call = {"id": "c1", "type": "function", "function": {"name": "interact_with_env", "arguments": {"choice": "answer",
            "content": "6"}}}  # fmt: skip
    history = [Message("user", USER), Message("assistant", "", tool_calls=[call]), Message("tool", "Wrong.")]
    prompt, _ = smollm2.present([Message("system", SYSTEM), *history], [INTERACT_TOOL])
    assert prompt[1:] == [Message("user", USER), Message("assistant", "[answer] 6"), Message("user", "Wrong.")]
    prompt, tools_shown = qwen3.present([Message("system", SYSTEM), *history], [INTERACT_TOOL])
    assert prompt[1:] == history and tools_shown == [INTERACT_TOOL]
    text = qwen3.render(prompt, tools_shown, generation=True)
    assert (
        qwen3.assistant_text(history[1], [INTERACT_TOOL]) in text
        and "<tool_response>\nWrong.\n</tool_response>" in text
    )


def test_hermes_on_a_template_without_tools_is_an_error(smollm2: ChatTemplate) -> None:
    hermes = ChatTemplate(smollm2.tokenizer, "hermes")
    with pytest.raises(ChatTemplateError) as err:
        hermes.present([Message("user", USER)], [INTERACT_TOOL])
    assert str(err.value) == (
        f"the chat template of {smollm2.tokenizer.name_or_path!r} ignores tools, so the policy would never see them; "
        "set model.tool_format=tags"
    )
    with pytest.raises(ValueError, match=r"model.tool_format = 'json'; choose from auto, hermes, tags"):
        ChatTemplate(smollm2.tokenizer, "json")


def test_auto_picks_hermes_where_the_template_asks_for_tool_calls_and_tags_elsewhere(
    qwen3: ChatTemplate, smollm2: ChatTemplate
) -> None:
    assert ChatTemplate(qwen3.tokenizer, "auto").tool_format == "hermes"
    assert ChatTemplate(smollm2.tokenizer, "auto").tool_format == "tags"
    assert ChatTemplate(smollm2.tokenizer).tool_format == "tags"  # auto is the default
    # A template that shows the schemas but not in Hermes blocks (Llama 3.1 style JSON) gets tags too.
    tokenizer = copy.copy(qwen3.tokenizer)
    tokenizer.chat_template = qwen3.tokenizer.chat_template.replace("<tool_call>", "<function>")
    assert ChatTemplate(tokenizer, "auto").tool_format == "tags"


def test_parse_hermes_tool_calls() -> None:
    text = (
        '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert parse_hermes_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", '{"y": 2}')]
    assert parse_hermes_tool_calls("no call here") == []
    with pytest.raises(ToolCallError, match=r"^<tool_call> block is not valid JSON \(Expecting"):
        parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": {</tool_call>')
    with pytest.raises(ToolCallError, match=r'^<tool_call> block must be a JSON object with a string "name"'):
        parse_hermes_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    with pytest.raises(ToolCallError, match=r"^a <tool_call> is not closed by </tool_call>$"):
        parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": {}}')
    # Hostile replies are bad calls, never exceptions of another kind (JSON too deep, a number past the digit limit).
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parse_hermes_tool_calls(f'<tool_call>{{"name": "a", "arguments": {deep}}}</tool_call>')
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parse_hermes_tool_calls(f'<tool_call>{{"name": "a", "arguments": {"9" * 5000}}}</tool_call>')
    with pytest.raises(ToolCallError, match="not closed"):
        parse_hermes_tool_calls("<tool_call>" * 20_000 + "</tool_call>")  # one pass, not one scan per tag


def test_actions_per_format(qwen3: ChatTemplate, smollm2: ChatTemplate) -> None:
    tools = [INTERACT_TOOL]
    reply = interact_call("search", "test", reasoning="x") + "\n" + interact_call("answer", "7")
    assert qwen3.actions(reply, tools) == ["[search] test", "[answer] 7"]
    assert qwen3.actions("plain text", tools) == []
    with pytest.raises(ToolCallError, match=r"^unknown tool 'lookup'; available: interact_with_env$"):
        qwen3.actions('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', tools)
    assert smollm2.actions(interact_call("answer", "7"), tools) == []  # tag lines are read by gyms.tools.text_to_action
