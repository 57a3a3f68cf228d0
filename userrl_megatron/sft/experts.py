"""Scripted expert trajectories for FunctionGym, as SFT rows: a built-in data source for CPU demos and tests.

The expert knows each task's rule (its record is in the task). It probes the function once with inputs that
are not the test case, reveals the test case with `[search] test` when the prompt does not state it, then
answers with the rule's value on the test case. Its replies go through the real `EpisodeRunner` and the real
FunctionGym, as a policy's would (the expert stands in for the engine: it returns the ids of its reply text and
the stop token), so the rows hold exactly the feedback, reward lines and roles a rollout would.

`expert:function-procedural` in `sft.train_files` (split train) or `sft.val_files` (split test) names this source.
"""

import asyncio
import json
from typing import Any

from userrl_megatron.config.schema import GymsConfig, RolloutConfig
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.sft.rows import SFTRow
from userrl_megatron.types import Episode, SamplingParams, Task
from userrl_megatron.wire.generation import Generation

EXPERT_PREFIX = "expert:"
EXPERT_SOURCES = ("function-procedural", "function")


class FunctionExpert:
    """A TurnEngine that plays one FunctionGym task: probe, (search,) answer."""

    def __init__(self, chat: ChatTemplate, task: Task) -> None:
        self.chat = chat
        self.replies = [reply_text(chat.tool_format, action) for action in expert_actions(task)]

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation:
        text = self.replies.pop(0) if self.replies else reply_text(self.chat.tool_format, "[finish]")
        ids = [*self.chat.encode(text), sampling.stop_token_ids[0]]
        return Generation(ids, [0.0] * len(ids), "stop", weight_version="expert")


def expert_actions(task: Task) -> list[str]:
    """The expert's gym actions for a FunctionGym task."""
    from gyms.function.rules import Rule

    record = task.metadata["record"]
    test_case = list(record["test_case"])
    probe = [1, 2, 3, 4] if test_case != [1, 2, 3, 4] else [2, 3, 4, 5]
    actions = [f"[action] {' '.join(map(str, probe))}"]
    if not any(str(test_case) in m.content for m in task.prompt):
        actions.append("[search] test")
    value = float(Rule(record["rule"])(test_case))
    actions.append(f"[answer] {int(value) if value.is_integer() else value}")
    return actions


def reply_text(tool_format: str, action: str) -> str:
    """How a policy writes `action` in `tool_format`: the tag line itself, or a Hermes call of interact_with_env."""
    if tool_format == "tags":
        return action
    choice, _, content = action.removeprefix("[").partition("]")
    arguments = {"choice": choice, "content": content.strip()}
    return f"<tool_call>\n{json.dumps({'name': 'interact_with_env', 'arguments': arguments})}\n</tool_call>"


def expert_rows(
    source: str, split: str, gyms: GymsConfig, rollout: RolloutConfig, chat: ChatTemplate, limit: int = 0
) -> list[SFTRow]:
    """Solved expert episodes of the FunctionGym tasks of `source` (`function-procedural` or `function`) and
    `split`, as rows (`limit` > 0: the first `limit` tasks)."""
    from userrl_megatron.data import load_tasks
    from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory

    if source not in EXPERT_SOURCES:
        raise ValueError(f"no scripted expert for {source!r}; experts: {', '.join(EXPERT_SOURCES)}")
    tasks = load_tasks([source], split, gyms)
    tasks = tasks[:limit] if limit else tasks
    runner = EpisodeRunner(rollout, chat, gym_factory(gyms, rollout.max_turns))

    async def play() -> list[Episode]:
        return list(await asyncio.gather(*(runner.run(t, FunctionExpert(chat, t)) for t in tasks)))

    episodes = asyncio.run(play())
    return [episode_row(e, chat, f"{EXPERT_PREFIX}{source}:{e.task.task_id}") for e in episodes if e.total_reward >= 1]


def episode_row(episode: Episode, chat: ChatTemplate, source: str = "") -> SFTRow:
    """The SFT row of a finished episode: its task's prompt, then its assistant turns and replies."""
    task = episode.task
    return conversation_row(task.prompt, task.tools, episode.metadata["messages"], chat, source)


def conversation_row(
    prompt: list[Any], tools: list[dict[str, Any]], conversation: list[Any], chat: ChatTemplate, source: str
) -> SFTRow:
    """A row from a task prompt and the conversation a runner recorded (the prompt as presented to the policy,
    then the turns): the raw prompt is kept, since tokenisation presents it again, then the turns."""
    from userrl_megatron.types import Message

    def message(m: Any) -> Message:
        return m if isinstance(m, Message) else Message(m["role"], m["content"], m.get("tool_calls"), m.get("name"))

    prompt = [message(m) for m in prompt]
    presented = len(chat.present(prompt, tools)[0])
    return SFTRow(prompt + [message(m) for m in conversation[presented:]], list(tools), source)
