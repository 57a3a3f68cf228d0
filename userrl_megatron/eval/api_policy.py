"""An OpenAI-compatible chat endpoint with tool calling as the policy (API models as baselines), the way UserRL's
`eval.py` drives one: the task's messages and tools go out, the reply's first tool call becomes the gym action,
and the assistant message (with that call) and a tool message with the gym's feedback are appended.

A reply without `tool_calls` is read as the token policies read text: `<tool_call>` blocks (servers that do not
parse tool calls), then a tag line, then the task's `reply_without_tool_call` rule. Transport and API errors
left after the client's own retries end the episode as `engine_error` (the evaluation retries it and, failing
again, reports it apart from the scores). The key comes from the environment variable `eval.api_key_env`.
"""

import os
import time
from typing import Any

from userrl_megatron.config.schema import EvalConfig, RolloutConfig
from userrl_megatron.errors import UserError
from userrl_megatron.rollout.episode import GymFactory
from userrl_megatron.types import Episode, FinishReason, SamplingParams, Task, Turn

CLIENT_RETRIES = 3  # retries of one chat request by the openai client (connection errors, 429, 5xx)


def api_identity(cfg: EvalConfig) -> dict[str, Any]:
    """An endpoint policy's identity: where, which model, how tools are requested."""
    return {"kind": "api", "endpoint": cfg.endpoint, "model": cfg.api_model, "tool_choice": cfg.api_tool_choice}


class _End(Exception):  # noqa: N818  (control flow, not an error)
    def __init__(self, reason: FinishReason, error: str | None = None) -> None:
        super().__init__(reason, error)
        self.reason = reason
        self.error = error


class ApiPolicy:
    """`async with ApiPolicy(eval_cfg, rollout_cfg, make_gym) as policy: await policy.run(task, id, sampling)`."""

    def __init__(self, cfg: EvalConfig, rollout: RolloutConfig, make_gym: GymFactory) -> None:
        if cfg.api_key_env == "none":
            key = "none"
        else:
            key = os.environ.get(cfg.api_key_env, "")
            if not key:
                raise UserError(
                    f"eval.api_key_env names {cfg.api_key_env}, which is not set: export the endpoint's key there "
                    "(or set eval.api_key_env=none for a server without auth)"
                )
        self.cfg = cfg
        self.rollout = rollout
        self.make_gym = make_gym
        self.key = key
        self.client: Any = None
        self.identity = {
            "kind": "api",
            "endpoint": cfg.endpoint,
            "model": cfg.api_model,
            "tool_choice": cfg.api_tool_choice,
        }
        self.concurrency = rollout.max_concurrent_episodes

    async def __aenter__(self) -> "ApiPolicy":
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(
            base_url=self.cfg.endpoint, api_key=self.key, timeout=self.rollout.request_timeout_s,
            max_retries=CLIENT_RETRIES,
        )  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def run(self, task: Task, episode_id: str, sampling: SamplingParams) -> Episode:
        """One episode of `task`; never raises for endpoint or gym failures (they end the episode)."""
        started = time.perf_counter()
        messages: list[dict[str, Any]] = [m.to_dict() for m in task.prompt]
        episode = Episode(task=task, group_id=task.task_id)
        episode.metadata.update(episode_id=episode_id, messages=messages)
        gym = None
        try:
            try:
                gym = self.make_gym(task)
                first = await gym.reset()
            except Exception as e:
                from gyms.user_sim import UserSimError

                reason: FinishReason = "user_sim_error" if isinstance(e, UserSimError) else "gym_error"
                raise _End(reason, f"{type(e).__name__}: {e}") from e
            from gyms.base import opens_with_user_message

            if opens_with_user_message(gym):
                messages.append({"role": "user", "content": first})
            await self._loop(task, episode, gym, messages, sampling)
        except _End as end:
            episode.finish_reason = end.reason
            if end.error is not None:
                episode.metadata["error"] = end.error
        finally:
            if gym is not None:
                try:
                    await gym.close()
                except Exception as e:  # recorded; the episode itself is complete
                    episode.metadata["close_error"] = f"{type(e).__name__}: {e}"
        episode.metadata["duration_s"] = round(time.perf_counter() - started, 4)
        return episode

    async def _loop(
        self, task: Task, episode: Episode, gym: Any, messages: list[dict[str, Any]], sampling: SamplingParams
    ) -> None:
        from gyms.tools import ToolCallError

        while True:
            started = time.perf_counter()
            choice = await self._complete(messages, task, sampling)
            message = choice.message
            text = message.content or ""
            turn = Turn(index=len(episode.turns), start=0, end=0, text=text)
            turn.info.update(generate_s=round(time.perf_counter() - started, 4), finish_reason=choice.finish_reason)
            episode.turns.append(turn)
            if choice.finish_reason == "length":
                raise _End("max_tokens")
            calls = list(message.tool_calls or [])
            assistant: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                assistant["tool_calls"] = [calls[0].model_dump(exclude_none=True)]
            messages.append(assistant)
            try:
                action = self._action(task, text, calls)
            except ToolCallError as e:
                turn.info["error"] = str(e)
                raise _End("bad_tool_call", str(e)) from e
            if action is None:
                raise _End("no_tool_call")
            turn.action = action
            step_started = time.perf_counter()
            try:
                result = await gym.step(action)
            except Exception as e:
                raise _End("gym_error", f"{type(e).__name__}: {e}") from e
            turn.info["step_s"] = round(time.perf_counter() - step_started, 4)
            turn.reward = result.reward
            feedback = result.feedback
            turn.feedback = f"{feedback}\nReward: {result.reward}" if self.rollout.reward_in_feedback else feedback
            if result.info:
                turn.info["step_info"] = [result.info]
            if calls:
                messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": turn.feedback})
            else:
                messages.append({"role": "user", "content": turn.feedback})
            if result.user_sim_error is not None:
                raise _End("user_sim_error", result.user_sim_error)
            if result.done:
                raise _End("done")
            if result.truncated:
                raise _End("truncated")
            if len(episode.turns) >= self.rollout.max_turns:
                raise _End("max_turns")

    async def _complete(self, messages: list[dict[str, Any]], task: Task, sampling: SamplingParams) -> Any:
        import openai

        request: dict[str, Any] = {
            "model": self.cfg.api_model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
            "n": 1,
        }
        if task.tools:
            request |= {"tools": task.tools, "tool_choice": self.cfg.api_tool_choice}
        if sampling.seed is not None:
            request["seed"] = sampling.seed
        try:
            response = await self.client.chat.completions.create(**request)
        except openai.OpenAIError as e:
            raise _End("engine_error", f"{type(e).__name__}: {e}") from e
        if not response.choices:
            raise _End("engine_error", "the endpoint answered without a choice")
        return response.choices[0]

    @staticmethod
    def _action(task: Task, text: str, calls: list[Any]) -> str | None:
        """The gym action of a reply: its first tool call, else a `<tool_call>` block or a tag line in its text."""
        from gyms.tools import text_to_action, tool_call_to_action
        from userrl_megatron.rollout.chat import parse_hermes_tool_calls

        if calls:
            return tool_call_to_action(calls[0].function.name, calls[0].function.arguments, task.tools)
        parsed = parse_hermes_tool_calls(text)
        if parsed:
            return tool_call_to_action(parsed[0].name, parsed[0].arguments, task.tools)
        return text_to_action(text, task.metadata.get("reply_without_tool_call", "end"))
