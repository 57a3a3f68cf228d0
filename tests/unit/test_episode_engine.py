"""EpisodeRunner on the real embedded engine and the real FunctionGym: the normal paths, token-exact.

A tiny random chat model (character tokenizer) plays many episodes concurrently; SmolLM2-135M-Instruct (a real
BPE tokenizer, whose sampled ids need not be the canonical tokenisation of their text) plays two.
"""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyms.base import parse_action
from gyms.function.rules import generate_function
from gyms.function.tasks import procedural_task
from tests.support.chatty import check_logprobs, function_task, make_chatty_model
from userrl_megatron.config.schema import EmbeddedServerConfig, GymsConfig, RolloutConfig
from userrl_megatron.model_store import resolve_model
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
from userrl_megatron.server.local import LocalEngine
from userrl_megatron.types import Episode, Message, SamplingParams, Task
from userrl_megatron.wire.generation import Generation

CONTINUING = {"max_turns", "truncated", "max_tokens", "done", "no_tool_call"}


class Recorder:
    """A real engine, with every (input ids, generation) pair it served kept for the checks."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], Generation]] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
        generation = await self.engine.generate(input_ids, sampling)
        self.calls.append((list(input_ids), generation))
        return generation


def check_token_exact(episode: Episode, recorder: Recorder, chat: ChatTemplate) -> None:
    """Trained ids are the engine's outputs; nothing else is trained; the text is the rendered conversation."""
    served = {(tuple(ids), tuple(g.output_ids), tuple(g.output_logprobs)) for ids, g in recorder.calls}
    for turn in episode.turns:
        span = slice(turn.start, turn.end)
        call = (
            tuple(episode.token_ids[: turn.start]),
            tuple(episode.token_ids[span]),
            tuple(episode.rollout_logprobs[span]),
        )
        assert call in served
    trained = sum(t.end - t.start for t in episode.turns)
    assert sum(episode.loss_mask) == trained
    assert episode.loss_mask[: episode.prompt_length] == [0] * episode.prompt_length
    messages = [Message(**m) for m in episode.metadata["messages"]]
    text = chat.decode(episode.token_ids)
    if episode.turns and episode.turns[-1].info["finish_reason"] == "length":
        assert text.startswith(chat.render(messages, None, generation=True))  # a cut turn has no message
    else:
        assert text == chat.render(messages, None, generation=False)


@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatty_model(tmp_path_factory.mktemp("chatty") / "model")


def play(
    model_dir: Path, cfg: RolloutConfig, tasks: list[Task], samples: int, concurrency: int
) -> tuple[list[Episode], Recorder, ChatTemplate]:
    """`samples` episodes of each task on a fresh in-process engine, under the tag format."""
    chat = ChatTemplate.from_pretrained(model_dir, "tags")
    engine = LocalEngine.launch(str(model_dir), EmbeddedServerConfig(max_running_requests=concurrency))
    try:
        recorder = Recorder(engine)
        runner = EpisodeRunner(cfg, chat, gym_factory(GymsConfig(), cfg.max_turns))
        groups = asyncio.run(runner.run_groups(tasks, samples, lambda _: recorder, concurrency=concurrency))
    finally:
        engine.close()
    return [e for g in groups for e in g.episodes], recorder, chat


def test_concurrent_episodes_on_the_embedded_engine(chatty: Path) -> None:
    """16 episodes, 8 at a time, on one engine: every trained token is exactly what the engine sampled."""
    cfg = RolloutConfig(max_turns=4, max_new_tokens_per_turn=24, max_response_tokens=300, max_prompt_tokens=400)
    tasks = [function_task(i, reply_without_tool_call="action") for i in range(4)]
    episodes, recorder, chat = play(chatty, cfg, tasks, samples=4, concurrency=8)
    assert len(episodes) == 16
    assert {e.finish_reason for e in episodes} <= CONTINUING
    assert max(len(e.turns) for e in episodes) >= 2  # multi-turn: replies went back to the model
    assert len(recorder.calls) == sum(len(e.turns) for e in episodes)
    model = AutoModelForCausalLM.from_pretrained(chatty, dtype=torch.float32)
    for episode in episodes:
        assert len(episode.token_ids) - episode.prompt_length <= cfg.max_response_tokens
        for turn in episode.turns:
            if turn.action is not None:  # every reply became a gym action, answered as a user message
                assert parse_action(turn.action)[0] is not None
                assert "Reward: 0.0" in turn.feedback
        check_token_exact(episode, recorder, chat)
        check_logprobs(episode, model)


@pytest.mark.slow
def test_smollm2_plays_function_gym_token_exact() -> None:
    """SmolLM2 with the tag format on a real FunctionGym task, greedy: token in, token out, whatever it writes."""
    path = resolve_model("smollm2-135m-instruct")
    cfg = RolloutConfig(max_turns=3, max_new_tokens_per_turn=40, max_response_tokens=400, temperature=0.0)
    generator = GymsConfig().function.generator
    tasks = [procedural_task(generate_function(generator, "test", 0), generator)]
    episodes, recorder, chat = play(path, cfg, tasks, samples=2, concurrency=2)
    assert all(e.finish_reason in CONTINUING for e in episodes)
    assert len(episodes[0].turns) >= 1
    assert episodes[0].token_ids == episodes[1].token_ids  # greedy: both samples of the group are the same
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for episode in episodes:
        check_token_exact(episode, recorder, chat)
        check_logprobs(episode, model)
