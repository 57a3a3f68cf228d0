"""Scripted engines and gyms for the episode paths a real model or gym cannot be made to take on demand
(malformed calls, failures, aborts, exact timing of concurrency). The normal paths are tested with real ones.
"""

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyms.base import StepResult
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import Generation

# What a scripted engine turn may be: reply text (tokenised, then ended by the stop token), a full Generation,
# or an exception to raise.
Script = str | Generation | BaseException


class ScriptedEngine:
    """Answers each generate call with the next scripted reply; records every request."""

    def __init__(self, chat: ChatTemplate, replies: list[Script], logprob: float = -0.5, version: str = "3") -> None:
        self.chat = chat
        self.replies = list(replies)
        self.logprob = logprob
        self.version = version  # the weight version it reports (a test may change it between turns)
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.generated: list[list[int]] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
        self.requests.append((list(input_ids), sampling))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, str):  # honour max_new_tokens as an engine would
            ids = [*self.chat.encode(reply), self.chat.stop_token_ids[0]]
            cut = len(ids) > sampling.max_new_tokens
            ids = ids[: sampling.max_new_tokens]
            reply = Generation(ids, [self.logprob] * len(ids), "length" if cut else "stop", weight_version=self.version)
        self.generated.append(list(reply.output_ids))
        return reply


@dataclass
class ScriptedGym:
    """Answers each step with the next scripted result (or raises it); records actions and whether it closed."""

    results: list[StepResult | BaseException] = field(default_factory=list)
    reset_error: BaseException | None = None
    close_error: BaseException | None = None
    name: str = "scripted"
    actions: list[str] = field(default_factory=list)
    closed: bool = False

    async def reset(self) -> str:
        if self.reset_error is not None:
            raise self.reset_error
        return "ready"

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        result = self.results.pop(0)
        if isinstance(result, BaseException):
            raise result
        return result

    async def close(self) -> None:
        self.closed = True
        if self.close_error is not None:
            raise self.close_error


class BarrierEngine:
    """Holds requests until `width` are in flight together, then lets every request through; records the peak.

    The peak reaches `width` however slowly requests arrive; where fewer may ever be in flight together, the
    deadline (only such a bug reaches it) lets them through with a short peak.
    """

    def __init__(self, reply: Callable[[list[int]], Generation], width: int, deadline_s: float = 60.0) -> None:
        self.reply = reply
        self.width = width
        self.deadline_s = deadline_s
        self.in_flight = 0
        self.peak = 0
        self._arrived = asyncio.Condition()

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
        async with self._arrived:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self._arrived.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait_for(lambda: self.peak >= self.width), self.deadline_s)
        reply = self.reply(input_ids)
        async with self._arrived:
            self.in_flight -= 1
        return reply


def step(
    feedback: str,
    reward: float = 0.0,
    done: bool = False,
    truncated: bool = False,
    user_sim_error: str | None = None,
    **info: Any,
) -> StepResult:
    """A StepResult, briefly."""
    return StepResult(feedback, reward, done, truncated, dict(info), user_sim_error)
