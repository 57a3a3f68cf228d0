"""The multi-turn EpisodeRunner: engine turns and gym steps, token-exact, many episodes at once.

One turn: `engine.generate(ids)` -> append the generated ids (trained, with their rollout log-probs) -> close
the assistant turn -> parse the reply into gym actions -> `gym.step` each -> append the reply messages and the
next generation prompt (untrained) -> repeat. Every episode ends with one recorded `finish_reason`, its gym is
always closed, and a failure ends only its own episode.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from gyms.base import Gym, opens_with_user_message
from gyms.tools import ToolCallError, text_to_action
from userrl_megatron.config.schema import GymsConfig, RolloutConfig
from userrl_megatron.observability.progress import HEARTBEAT_S, heartbeat
from userrl_megatron.rollout.admission import Admission, GroupGate
from userrl_megatron.rollout.chat import ChatTemplate, ChatTemplateError
from userrl_megatron.types import Episode, EpisodeGroup, FinishReason, Message, Role, SamplingParams, Task, Turn
from userrl_megatron.wire.generation import Generation

log = logging.getLogger(__name__)

GymFactory = Callable[[Task], Gym]
T = TypeVar("T")


class TurnEngine(Protocol):
    """What an episode needs from an engine: a `RolloutEngine`, or a pool's per-episode session."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, routed_experts_start_len: int | None = None
    ) -> Generation: ...


EngineFor = Callable[[str], TurnEngine]  # episode id -> the engine that serves it (sticky per episode)


class _EpisodeEnd(Exception):  # noqa: N818  (control flow, not an error)
    """Raised inside an episode to end it with `reason` (and the error that ended it, if any)."""

    def __init__(self, reason: FinishReason, error: str | None = None) -> None:
        super().__init__(reason, error)
        self.reason = reason
        self.error = error


class EpisodeRunner:
    """Runs episodes of tasks against engines and gyms under one `RolloutConfig`.

    `chat` applies the policy's chat template in token space; `make_gym` builds (not resets) the gym of a task.
    A reply without tool calls goes through `gyms.tools.text_to_action` with the task's
    `metadata["reply_without_tool_call"]`: a tag line is the action; otherwise "end" (default) ends the episode
    as `no_tool_call` (the turn keeps reward 0 and still counts) and "action" sends the text as
    `[action] <text>` (tau-bench style). The gym's answer to such an action comes back as a user message.
    """

    def __init__(self, cfg: RolloutConfig, chat: ChatTemplate, make_gym: GymFactory) -> None:
        self.cfg = cfg
        self.chat = chat
        self.make_gym = make_gym
        self.heartbeat_s = HEARTBEAT_S  # seconds between `rollout: N/M episodes done` lines of run_groups
        self.routing_replay = False  # ask the engine for its MoE routing every turn (algo.routing_replay: rollout)

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        """Sampling of one turn under the config (the turn's token limit is applied per call)."""
        return SamplingParams(
            max_new_tokens=self.cfg.max_new_tokens_per_turn,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            stop_token_ids=self.chat.stop_token_ids,
        )

    async def run_groups(
        self,
        tasks: list[Task],
        n_samples: int,
        engine_for: EngineFor,
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
        gate: GroupGate | None = None,
    ) -> list[EpisodeGroup]:
        """`n_samples` episodes of every task, at most `concurrency` in flight (default: the config's), admitted a
        whole group at a time so that a group's episodes start on the same weights (`GroupGate`); `gate` instead
        shares one gate with other calls running at the same time."""
        gate = gate or GroupGate(concurrency or self.cfg.max_concurrent_episodes)
        groups = [EpisodeGroup(uuid.uuid4().hex[:16], task) for task in tasks]
        done = [0]

        async def one(group: EpisodeGroup, sample: int, admission: Admission) -> Episode:
            episode_id = f"{group.group_id}-{sample}"
            async with admission.slot():
                try:
                    episode = await self.run(group.task, engine_for(episode_id), group.group_id, sampling, episode_id)
                except ChatTemplateError:
                    raise  # a configuration problem (tool format vs template): the same for every episode
                except Exception as e:  # a bug outside the engine/gym calls must still not fail the batch
                    log.exception("episode %s (%s/%s) failed", episode_id, group.task.gym, group.task.task_id)
                    episode = Episode(task=group.task, group_id=group.group_id, finish_reason="gym_error")
                    episode.metadata.update(episode_id=episode_id, error=f"{type(e).__name__}: {e}")
                done[0] += 1
                return episode

        async def whole(group: EpisodeGroup) -> None:
            async with gate.admit(n_samples) as admission:
                group.episodes = await _every([one(group, i, admission) for i in range(n_samples)])

        total = len(groups) * n_samples
        async with heartbeat(lambda: f"rollout: {done[0]}/{total} episodes done", self.heartbeat_s):
            await _every([whole(group) for group in groups])
        return groups

    async def run(
        self,
        task: Task,
        engine: TurnEngine,
        group_id: str = "",
        sampling: SamplingParams | None = None,
        episode_id: str = "",
    ) -> Episode:
        """One episode of `task` on `engine`; never raises for engine or gym failures (they end the episode)."""
        started = time.perf_counter()
        episode = Episode(task=task, group_id=group_id)
        gym: Gym | None = None
        failed: _EpisodeEnd | None = None
        opening: list[Message] = []
        try:
            gym = self.make_gym(task)
            first = await gym.reset()
            if opens_with_user_message(gym):
                opening = [Message("user", first)]
        except Exception as e:
            failed = _reset_failure(e)
        try:
            messages, tools = self.chat.present([*task.prompt, *opening], task.tools)
            episode.metadata.update(episode_id=episode_id, messages=[m.to_dict() for m in messages])
            prompt = self.chat.prompt_ids(messages, tools)
            episode.append(prompt, trained=False)
            episode.prompt_length = len(prompt)
            if len(prompt) > self.cfg.max_prompt_tokens:
                raise _EpisodeEnd("max_tokens", f"prompt has {len(prompt)} tokens > rollout.max_prompt_tokens")
            if failed is not None:
                raise failed
            assert gym is not None
            await self._loop(episode, gym, engine, sampling or self.sampling(), tools)
        except _EpisodeEnd as end:
            episode.finish_reason = end.reason
            if end.error is not None:
                episode.metadata["error"] = end.error
        finally:
            if gym is not None:
                await _close(gym, episode)
        episode.metadata["duration_s"] = round(time.perf_counter() - started, 4)
        episode.check()
        return episode

    async def _loop(
        self,
        episode: Episode,
        gym: Gym,
        engine: TurnEngine,
        sampling: SamplingParams,
        tools: list[dict[str, Any]] | None,
    ) -> None:
        """Turns until one raises `_EpisodeEnd`."""
        reserve = len(self.chat.turn_suffix_ids(tools))  # room kept to close the turn after its last token
        while True:
            room = self._room(episode) - reserve
            if room < 1:
                raise _EpisodeEnd("max_tokens")
            turn_sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
            turn, generation = await self._generate(episode, engine, turn_sampling)
            if generation.finish_reason == "length":
                raise _EpisodeEnd("max_tokens")  # a cut reply is never parsed
            episode.append(self.chat.close_turn_ids(generation.output_ids, tools), trained=False)
            episode.metadata["messages"].append({"role": "assistant", "content": turn.text})
            replies = await self._act(episode.task, gym, turn)
            if len(episode.turns) >= self.cfg.max_turns:
                raise _EpisodeEnd("max_turns")
            reply = self.chat.reply_ids(replies, tools)
            if len(reply) + reserve + 1 > self._room(episode):
                raise _EpisodeEnd("max_tokens")
            episode.append(reply, trained=False)
            episode.metadata["messages"] += [m.to_dict() for m in replies]

    def _room(self, episode: Episode) -> int:
        """Tokens left in the episode's response budget."""
        return self.cfg.max_response_tokens - (len(episode.token_ids) - episode.prompt_length)

    async def _generate(
        self, episode: Episode, engine: TurnEngine, sampling: SamplingParams
    ) -> tuple[Turn, Generation]:
        """Generate one assistant turn and append it, trained, with its log-probs."""
        started = time.perf_counter()
        routed_from = episode.routed_length if self.routing_replay else None
        try:
            if routed_from is None:
                generation = await engine.generate(episode.token_ids, sampling)
            else:  # the engine routes the new context and the reply; earlier positions are recorded already
                generation = await engine.generate(episode.token_ids, sampling, routed_experts_start_len=routed_from)
        except Exception as e:
            raise _EpisodeEnd("engine_error", _describe(e)) from e
        if generation.finish_reason == "abort":
            raise _EpisodeEnd("engine_error", "the engine aborted the request")
        if routed_from is not None:
            rows = len(episode.token_ids) + len(generation.output_ids) - 1 - routed_from
            routed = generation.routed_experts
            if routed is None or len(routed) != rows:
                got = "none" if routed is None else len(routed)
                raise _EpisodeEnd("engine_error", f"the engine returned routed experts for {got} positions, not {rows}")
            episode.routed_experts.append(routed)
        ids, logprobs = generation.output_ids, generation.output_logprobs
        if len(logprobs) != len(ids):
            raise _EpisodeEnd("engine_error", f"the engine returned {len(ids)} tokens but {len(logprobs)} log-probs")
        index, start = len(episode.turns), len(episode.token_ids)
        episode.append(generation.output_ids, trained=True, turn=index, logprobs=generation.output_logprobs)
        content = generation.output_ids
        if generation.finish_reason == "stop" and content and content[-1] in sampling.stop_token_ids:
            content = content[:-1]
        version = _version_number(generation.weight_version)
        turn = Turn(index, start, len(episode.token_ids), self.chat.decode(content), weight_version=version)
        turn.info.update(
            generate_s=round(time.perf_counter() - started, 4),
            finish_reason=generation.finish_reason,
            weight_version=generation.weight_version,
        )
        episode.turns.append(turn)
        episode.weight_version = version if index == 0 else min(episode.weight_version, version)
        return turn, generation

    async def _act(self, task: Task, gym: Gym, turn: Turn) -> list[Message]:
        """Parse the turn's reply, step the gym with each action, and return the reply messages."""
        role: Role = "tool"
        try:
            actions = self.chat.actions(turn.text, task.tools)
        except ToolCallError as e:
            turn.info["error"] = str(e)
            raise _EpisodeEnd("bad_tool_call", str(e)) from e
        if not actions:  # a tag line, or the whole text under reply_without_tool_call "action"; answered as a user
            mode = self.cfg.reply_without_tool_call or task.metadata.get("reply_without_tool_call", "end")
            action = text_to_action(turn.text, mode)
            if action is None:
                raise _EpisodeEnd("no_tool_call")
            actions, role = [action], "user"
        turn.action = actions[0]
        if len(actions) > 1:
            turn.info["actions"] = actions
        started = time.perf_counter()
        try:
            return await self._step(gym, actions, role, turn)
        finally:
            turn.info["step_s"] = round(time.perf_counter() - started, 4)

    async def _step(self, gym: Gym, actions: list[str], role: Role, turn: Turn) -> list[Message]:
        """Apply the actions in order until one ends the episode; the turn's reward is their sum."""
        replies: list[Message] = []
        for action in actions:
            try:
                result = await gym.step(action)
            except Exception as e:
                raise _EpisodeEnd("gym_error", _describe(e)) from e
            turn.reward += result.reward
            text = f"{result.feedback}\nReward: {result.reward}" if self.cfg.reward_in_feedback else result.feedback
            replies.append(Message(role, text))
            turn.feedback = "\n".join(m.content for m in replies)
            if result.info:
                turn.info.setdefault("step_info", []).append(result.info)
            if result.user_sim_error is not None:
                raise _EpisodeEnd("user_sim_error", result.user_sim_error)
            if result.done:
                raise _EpisodeEnd("done")
            if result.truncated:
                raise _EpisodeEnd("truncated")
        return replies


def gym_factory(gyms_cfg: GymsConfig, max_steps: int, user_sim: Any = None) -> GymFactory:
    """Builds each task's gym from the registry with its typed config (`max_steps` = the rollout's max turns)."""
    from gyms import config_for, make_gym

    return lambda task: make_gym(task.gym, task, config_for(task.gym, gyms_cfg, max_steps), user_sim)


async def _every(jobs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of all `jobs`, in order. On the first failure or a cancellation the others are cancelled and
    awaited, so none keeps running (and holding a slot of a shared gate) after the call."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _close(gym: Gym, episode: Episode) -> None:
    try:
        await gym.close()
    except Exception as e:  # a failed close is logged and recorded; the episode itself is complete
        log.warning("closing gym %s failed: %s", gym.name, e)
        episode.metadata["close_error"] = _describe(e)


def _reset_failure(e: BaseException) -> _EpisodeEnd:
    """How a gym that could not be built or reset ends its episode: `user_sim_error` when the user simulator
    failed (a gym whose first message comes from it), `gym_error` otherwise."""
    from gyms.user_sim import UserSimError

    return _EpisodeEnd("user_sim_error" if isinstance(e, UserSimError) else "gym_error", _describe(e))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _version_number(label: str) -> int:
    """SGLang weight versions are labels; the trainer's are step numbers ("default" before any update = 0)."""
    return int(label) if label.isdigit() else 0
