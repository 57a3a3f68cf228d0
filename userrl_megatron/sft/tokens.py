"""An SFT conversation as token ids and a loss mask, built exactly as the episode runner builds a rollout.

The same `ChatTemplate` calls in the same order as `rollout/episode.py`: the presented prompt with its generation
prompt (untrained); per assistant message, the ids a policy generating its text would emit, ending with the stop
token (trained: `encode(text) + [stop]`); the rest of the turn suffix (untrained); the reply messages before the
next assistant message with the next generation prompt (untrained). Messages after the last assistant message are
dropped, as a rollout ends after its last turn. So an SFT sample and a rollout of the same conversation have the
same ids and the same mask (tests/unit/test_sft_tokens.py).
"""

from dataclasses import dataclass
from typing import Any

from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.sft.rows import RowError, SFTRow
from userrl_megatron.types import Episode, Message, Task


@dataclass
class Sample:
    """One tokenised conversation."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (every assistant turn), 0 elsewhere
    source: str = ""

    def __len__(self) -> int:
        return len(self.token_ids)


def tokenize_row(chat: ChatTemplate, row: SFTRow, max_tokens: int = 0) -> Sample:
    """The sample of `row`; RowError when it cannot be rendered or is longer than `max_tokens` (0: no limit)."""
    episode = conversation_episode(chat, row.messages, row.tools)
    if max_tokens and len(episode.token_ids) > max_tokens:
        raise RowError(f"{len(episode.token_ids)} tokens, more than the limit of {max_tokens}")
    return Sample(episode.token_ids, episode.loss_mask, row.source)


def conversation_episode(chat: ChatTemplate, messages: list[Message], tools: list[dict[str, Any]]) -> Episode:
    """The token-exact Episode of a finished conversation (its turns trained), as the runner would record it."""
    from gyms.tools import ToolCallError
    from userrl_megatron.rollout.chat import ChatTemplateError

    first = next(i for i, m in enumerate(messages) if m.role == "assistant")
    try:
        prompt, shown_tools = chat.present(messages[:first], tools)
        episode = Episode(task=Task(gym="sft", task_id="", prompt=messages[:first], tools=tools), group_id="")
        episode.append(chat.prompt_ids(prompt, shown_tools), trained=False)
        episode.prompt_length = len(episode.token_ids)
        stop = chat.turn_suffix_ids(shown_tools)[:1]
        if not stop:
            raise ChatTemplateError("the chat template writes nothing after an assistant message: no stop token")
        turn, replies = 0, []
        for message in messages[first:]:
            if message.role != "assistant":
                replies.append(message)
                continue
            if replies:
                episode.append(chat.reply_ids(replies, shown_tools), trained=False)
                replies = []
            generated = chat.encode(chat.assistant_text(message, tools)) + stop
            episode.append(generated, trained=True, turn=turn)
            episode.append(chat.close_turn_ids(generated, shown_tools), trained=False)
            turn += 1
    except (ChatTemplateError, ToolCallError) as e:
        raise RowError(str(e)) from e
    return episode
