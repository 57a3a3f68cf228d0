"""EpisodeRunner: every stop reason, token exactness, the gym always closed, concurrency and isolation.

Scripted engines and gyms drive the paths a real model cannot be made to take on demand; the normal paths
with a real engine are in tests/unit/test_episode_engine.py.
"""

import asyncio

import pytest

from gyms.tools import INTERACT_TOOL
from gyms.user_sim import UserSimError
from tests.support.chat_templates import interact_call, qwen3_chat, smollm2_chat
from tests.support.scripted import BarrierEngine, ScriptedEngine, ScriptedGym, step
from userrl_megatron.config.schema import RolloutConfig
from userrl_megatron.rollout.chat import ChatTemplate, ChatTemplateError
from userrl_megatron.rollout.episode import EpisodeRunner
from userrl_megatron.types import Episode, Message, SamplingParams, Task
from userrl_megatron.wire.generation import Generation

IM_END = 151645


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    return qwen3_chat()


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    return smollm2_chat()


def call(choice: str, content: str) -> str:
    return interact_call(choice, content, reasoning="Next.")


def task(task_id: str = "func-1", **metadata: object) -> Task:
    prompt = [Message("system", "Guess the hidden function."), Message("user", "Begin.")]
    return Task("function", task_id, prompt, tools=[INTERACT_TOOL], metadata=dict(metadata))


def config(**overrides: object) -> RolloutConfig:
    return RolloutConfig(**{"max_turns": 8, "max_response_tokens": 1024, "max_new_tokens_per_turn": 128, **overrides})


def run(chat: ChatTemplate, engine: ScriptedEngine, gym: ScriptedGym, t: Task | None = None, **cfg: object) -> Episode:
    runner = EpisodeRunner(config(**cfg), chat, lambda _: gym)
    return asyncio.run(runner.run(t or task(), engine, group_id="g"))


def trained_ids(episode: Episode) -> list[int]:
    return [t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True) if m]


def rendered(chat: ChatTemplate, episode: Episode) -> list[int]:
    """apply_chat_template of the episode's conversation, as ids."""
    messages = [Message(**m) for m in episode.metadata["messages"]]
    return chat.encode(chat.render(messages, episode.task.tools, generation=False))


def test_solved_episode_is_token_exact(qwen3: ChatTemplate) -> None:
    replies = [call("search", "test"), call("action", "1 1 1 1"), call("answer", "3")]
    engine = ScriptedEngine(qwen3, replies)
    gym = ScriptedGym(
        [
            step("Test case: [1, 2, 3, 4]"),
            step("For numbers [1, 1, 1, 1], the result is 2."),
            step("Your answer is correct!", 1.0, done=True),
        ]
    )
    episode = run(qwen3, engine, gym)
    assert episode.finish_reason == "done"
    assert gym.actions == ["[search] test", "[action] 1 1 1 1", "[answer] 3"]
    assert gym.closed
    assert episode.turn_rewards == [0.0, 0.0, 1.0]
    assert [t.feedback for t in episode.turns] == [
        "Test case: [1, 2, 3, 4]\nReward: 0.0",
        "For numbers [1, 1, 1, 1], the result is 2.\nReward: 0.0",
        "Your answer is correct!\nReward: 1.0",
    ]
    # Token in, token out: the trained ids are exactly the generated ones, turn by turn.
    assert trained_ids(episode) == [t for g in engine.generated for t in g]
    for turn, generated in zip(episode.turns, engine.generated, strict=True):
        assert episode.token_ids[turn.start : turn.end] == generated
        assert set(episode.turn_index[turn.start : turn.end]) == {turn.index}
        assert episode.rollout_logprobs[turn.start : turn.end] == [-0.5] * len(generated)
    # Each request continued exactly what the episode held at the time.
    for (request, _), turn in zip(engine.requests, episode.turns, strict=True):
        assert request == episode.token_ids[: turn.start]
    # The conversation renders to exactly these ids; the last turn is closed, its feedback not appended.
    assert episode.token_ids == rendered(qwen3, episode)
    assert episode.metadata["messages"][-1] == {"role": "assistant", "content": episode.turns[-1].text}
    assert episode.weight_version == 3 and [t.weight_version for t in episode.turns] == [3, 3, 3]
    assert [t.info["finish_reason"] for t in episode.turns] == ["stop"] * 3
    assert all(t.info["generate_s"] >= 0 and t.info["step_s"] >= 0 for t in episode.turns)


def test_reward_line_is_optional(qwen3: ChatTemplate) -> None:
    engine = ScriptedEngine(qwen3, [call("search", "test"), call("answer", "3")])
    gym = ScriptedGym([step("Test case: [1, 2, 3, 4]"), step("Correct!", 1.0, done=True)])
    episode = run(qwen3, engine, gym, reward_in_feedback=False)
    assert episode.metadata["messages"][3] == {"role": "tool", "content": "Test case: [1, 2, 3, 4]"}
    assert episode.token_ids == rendered(qwen3, episode)


def test_tag_format_replies_come_back_as_user_messages(smollm2: ChatTemplate) -> None:
    engine = ScriptedEngine(smollm2, ["I need the test case.\n[search] test", "[answer] 3"])
    gym = ScriptedGym([step("Test case: [1, 2, 3, 4]"), step("Correct!", 1.0, done=True)])
    episode = run(smollm2, engine, gym)
    assert episode.finish_reason == "done"
    assert gym.actions == ["[search] test", "[answer] 3"]
    assert episode.metadata["messages"][3] == {"role": "user", "content": "Test case: [1, 2, 3, 4]\nReward: 0.0"}
    assert episode.token_ids == rendered(smollm2, episode)
    assert trained_ids(episode) == [t for g in engine.generated for t in g]


def test_several_tool_calls_in_one_turn_step_in_order(qwen3: ChatTemplate) -> None:
    two = call("action", "1 1 1 1") + "\n" + interact_call("action", "2 1 1 1")
    engine = ScriptedEngine(qwen3, [two, call("answer", "3")])
    gym = ScriptedGym([step("r1", 0.25), step("r2", 0.5), step("Correct!", 1.0, done=True)])
    episode = run(qwen3, engine, gym)
    assert gym.actions == ["[action] 1 1 1 1", "[action] 2 1 1 1", "[answer] 3"]
    assert episode.turn_rewards == [0.75, 1.0]
    assert episode.turns[0].info["actions"] == ["[action] 1 1 1 1", "[action] 2 1 1 1"]
    assert [m["role"] for m in episode.metadata["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert episode.token_ids == rendered(qwen3, episode)


def test_truncated_by_the_gym(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("a"), step("Out of steps.", truncated=True)])
    episode = run(qwen3, ScriptedEngine(qwen3, [call("action", "1 1 1 1")] * 2), gym)
    assert (episode.finish_reason, len(episode.turns), gym.closed) == ("truncated", 2, True)


def test_max_turns(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("r")] * 5)
    episode = run(qwen3, ScriptedEngine(qwen3, [call("action", "1 1 1 1")] * 5), gym, max_turns=3)
    assert (episode.finish_reason, len(episode.turns), len(gym.actions)) == ("max_turns", 3, 3)
    assert episode.token_ids == rendered(qwen3, episode)  # the last reply is not appended


def test_max_tokens_keeps_the_episode_inside_its_budget(qwen3: ChatTemplate) -> None:
    reply, feedback = call("action", "1 1 1 1"), "For numbers [1, 1, 1, 1], the result is 2."
    generated = len(qwen3.encode(reply)) + 1  # + <|im_end|>
    tool = len(qwen3.reply_ids([Message("tool", f"{feedback}\nReward: 0.0")]))
    turn = generated + 1 + tool  # generation, turn separator, tool reply with the next generation prompt

    # Two full turns fit; the third generation gets the 10 - 2 tokens left (2 kept to close the turn) and is cut.
    engine = ScriptedEngine(qwen3, [reply] * 5)
    episode = run(qwen3, engine, ScriptedGym([step(feedback)] * 5), max_response_tokens=2 * turn + 10)
    assert (episode.finish_reason, len(episode.turns)) == ("max_tokens", 3)
    assert [request[1].max_new_tokens for request in engine.requests] == [128, turn + 8, 8]
    assert episode.turns[-1].info["finish_reason"] == "length"
    assert len(episode.token_ids) - episode.prompt_length == 2 * turn + 8

    # The first tool reply does not fit with room for one more token and the 2 closing ones: it is not appended.
    engine = ScriptedEngine(qwen3, [reply] * 5)
    episode = run(qwen3, engine, ScriptedGym([step(feedback)] * 5), max_response_tokens=turn + 2)
    assert (episode.finish_reason, len(episode.turns)) == ("max_tokens", 1)
    assert len(episode.token_ids) - episode.prompt_length == generated + 1
    episode = run(
        qwen3, ScriptedEngine(qwen3, [reply] * 5), ScriptedGym([step(feedback)] * 5), max_response_tokens=turn + 3
    )
    assert [t.end - t.start for t in episode.turns] == [generated, 1]


def test_a_reply_cut_at_the_token_limit_ends_the_episode_unparsed(qwen3: ChatTemplate) -> None:
    cut = qwen3.encode(call("answer", "3"))[:10]
    gym = ScriptedGym()
    episode = run(qwen3, ScriptedEngine(qwen3, [Generation(cut, [-1.0] * 10, "length")]), gym)
    assert (episode.finish_reason, gym.actions, gym.closed) == ("max_tokens", [], True)
    assert episode.token_ids[episode.prompt_length :] == cut  # not closed: nothing follows a cut turn


def test_prompt_longer_than_its_budget(qwen3: ChatTemplate) -> None:
    engine = ScriptedEngine(qwen3, [])
    episode = run(qwen3, engine, ScriptedGym(), max_prompt_tokens=8)
    assert episode.finish_reason == "max_tokens"
    assert episode.metadata["error"] == f"prompt has {episode.prompt_length} tokens > rollout.max_prompt_tokens"
    assert engine.requests == [] and episode.turns == []


def test_no_tool_call_ends_with_a_zero_reward_turn(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("r")])
    episode = run(qwen3, ScriptedEngine(qwen3, [call("search", "test"), "I give up."]), gym)
    assert episode.finish_reason == "no_tool_call"
    assert [t.text for t in episode.turns][-1] == "I give up."
    assert episode.turn_rewards == [0.0, 0.0]
    assert gym.actions == ["[search] test"]


def test_reply_without_tool_call_as_action_goes_to_the_user(qwen3: ChatTemplate) -> None:
    replies = ["<think>\nAsk the user.\n</think>\n\nWhich order do you mean?", call("answer", "order 7")]
    gym = ScriptedGym([step("The one from May."), step("Done.", 1.0, done=True)])
    episode = run(qwen3, ScriptedEngine(qwen3, replies), gym, task(reply_without_tool_call="action"))
    assert gym.actions == ["[action] Which order do you mean?", "[answer] order 7"]
    assert episode.metadata["messages"][3] == {"role": "user", "content": "The one from May.\nReward: 0.0"}
    assert episode.finish_reason == "done"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "<tool_call> block is not valid JSON (Expecting property name"),
        (
            '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>',
            "unknown tool 'lookup'; available: interact_with_env",
        ),
        (
            '<tool_call>{"name": "interact_with_env", "arguments": "[1]"}</tool_call>',
            "tool arguments must be a JSON object, got list",
        ),
    ],
)
def test_bad_tool_call(qwen3: ChatTemplate, reply: str, error: str) -> None:
    gym = ScriptedGym()
    episode = run(qwen3, ScriptedEngine(qwen3, [reply]), gym)
    assert episode.finish_reason == "bad_tool_call"
    assert episode.metadata["error"].startswith(error)
    assert (gym.actions, gym.closed, episode.turn_rewards) == ([], True, [0.0])


def test_gym_errors(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("r"), RuntimeError("state corrupted")])
    episode = run(qwen3, ScriptedEngine(qwen3, [call("search", "test"), call("answer", "3")]), gym)
    assert (episode.finish_reason, episode.metadata["error"], gym.closed) == (
        "gym_error",
        "RuntimeError: state corrupted",
        True,
    )
    gym = ScriptedGym(reset_error=KeyError("func-9"))
    episode = run(qwen3, ScriptedEngine(qwen3, []), gym)
    assert (episode.finish_reason, episode.metadata["error"], gym.closed) == ("gym_error", "KeyError: 'func-9'", True)

    def no_gym(_: Task) -> ScriptedGym:
        raise ValueError("unknown task func-9")

    runner = EpisodeRunner(config(), qwen3, no_gym)
    episode = asyncio.run(runner.run(task(), ScriptedEngine(qwen3, [])))
    assert (episode.finish_reason, episode.metadata["error"]) == ("gym_error", "ValueError: unknown task func-9")


def test_user_simulator_failure(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("(no reply)", user_sim_error="simulator unreachable after 4 retries")])
    episode = run(qwen3, ScriptedEngine(qwen3, [call("action", "hello")]), gym)
    assert episode.finish_reason == "user_sim_error"
    assert episode.metadata["error"] == "simulator unreachable after 4 retries"
    assert "step_info" not in episode.turns[0].info  # the failure is the step's typed field, not an info key
    assert gym.closed


class OpeningGym(ScriptedGym):
    """A gym whose reset returns the user's first message (`first_message_at_reset`, the tau2 gyms)."""

    first_message_at_reset = True

    async def reset(self) -> str:
        await super().reset()
        return "Hi, I need help with my order."


def test_the_first_user_message_from_reset_ends_the_prompt(qwen3: ChatTemplate) -> None:
    gym = OpeningGym([step("Done.", 1.0, done=True)])
    t = Task(
        "tau2_mock_chat",
        "t",
        [Message("system", "Policy."), Message("assistant", "Hi! How can I help?")],
        [INTERACT_TOOL],
    )
    engine = ScriptedEngine(qwen3, [call("answer", "3")])
    episode = run(qwen3, engine, gym, t)
    assert [m["role"] for m in episode.metadata["messages"][:3]] == ["system", "assistant", "user"]
    assert episode.metadata["messages"][2]["content"] == "Hi, I need help with my order."
    prompt = qwen3.decode(episode.token_ids[: episode.prompt_length])
    assert prompt.endswith("Hi, I need help with my order.<|im_end|>\n<|im_start|>assistant\n")
    assert not any(episode.loss_mask[: episode.prompt_length])  # the user's words never train
    assert episode.finish_reason == "done"


def test_a_simulator_failure_at_reset_is_a_user_sim_error(qwen3: ChatTemplate) -> None:
    gym = OpeningGym(reset_error=UserSimError("cannot reach the simulator", "connection", 5))
    episode = run(qwen3, ScriptedEngine(qwen3, []), gym)
    assert (episode.finish_reason, gym.closed) == ("user_sim_error", True)
    assert episode.metadata["error"] == "UserSimError: cannot reach the simulator"


def test_engine_failures(qwen3: ChatTemplate) -> None:
    cases = [
        (ConnectionError("engine 1 unreachable"), "ConnectionError: engine 1 unreachable"),
        (Generation([5], [-0.1], "abort"), "the engine aborted the request"),
        (Generation([5, 6], [-0.1], "stop"), "the engine returned 2 tokens but 1 log-probs"),
    ]
    for failure, error in cases:
        gym = ScriptedGym([step("r")])
        episode = run(qwen3, ScriptedEngine(qwen3, [call("search", "test"), failure]), gym)
        assert (episode.finish_reason, episode.metadata["error"], gym.closed) == ("engine_error", error, True)
        assert len(episode.turns) == 1


def test_a_failing_close_is_recorded(qwen3: ChatTemplate) -> None:
    gym = ScriptedGym([step("Correct!", 1.0, done=True)], close_error=OSError("socket already closed"))
    episode = run(qwen3, ScriptedEngine(qwen3, [call("answer", "3")]), gym)
    assert (episode.finish_reason, episode.metadata["close_error"]) == ("done", "OSError: socket already closed")


def test_groups_run_concurrently_up_to_the_limit(qwen3: ChatTemplate) -> None:
    answer = [*qwen3.encode(call("answer", "3")), IM_END]
    engine = BarrierEngine(lambda _: Generation(answer, [-0.2] * len(answer), "stop"), width=4)
    gyms: list[ScriptedGym] = []

    def make(_: Task) -> ScriptedGym:
        gyms.append(ScriptedGym([step("Correct!", 1.0, done=True)]))
        return gyms[-1]

    runner = EpisodeRunner(config(), qwen3, make)
    groups = asyncio.run(runner.run_groups([task("a"), task("b")], 4, lambda _: engine, concurrency=4))
    assert engine.peak == 4
    assert [g.task.task_id for g in groups] == ["a", "b"]
    assert [[e.finish_reason for e in g.episodes] for g in groups] == [["done"] * 4] * 2
    assert [g.scores for g in groups] == [[1.0] * 4] * 2
    ids = [e.metadata["episode_id"] for g in groups for e in g.episodes]
    assert ids == [f"{g.group_id}-{i}" for g in groups for i in range(4)]
    assert all(e.group_id == g.group_id for g in groups for e in g.episodes)
    assert len(gyms) == 8 and all(g.closed for g in gyms)


def test_one_failing_episode_does_not_fail_the_batch(qwen3: ChatTemplate) -> None:
    """An engine failure, a gym that cannot be built and a gym answering garbage each end only their episode."""
    ok = call("answer", "3")

    class Engines:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, episode_id: str) -> ScriptedEngine:
            self.calls += 1
            failure = TimeoutError("generate timed out") if self.calls == 2 else ok
            return ScriptedEngine(qwen3, [failure])

    def make(t: Task) -> ScriptedGym:
        if t.task_id == "broken":
            raise FileNotFoundError("functions.json")
        if t.task_id == "garbage":
            gym = ScriptedGym()
            gym.results = [None]  # type: ignore[list-item]  # a gym bug: step returns nothing
            return gym
        return ScriptedGym([step("Correct!", 1.0, done=True)])

    runner = EpisodeRunner(config(), qwen3, make)
    groups = asyncio.run(runner.run_groups([task("a"), task("broken"), task("garbage")], 2, Engines()))
    reasons = [[e.finish_reason for e in g.episodes] for g in groups]
    assert reasons == [["done", "engine_error"], ["gym_error"] * 2, ["gym_error"] * 2]
    assert groups[0].episodes[1].metadata["error"] == "TimeoutError: generate timed out"
    assert groups[1].episodes[0].metadata["error"] == "FileNotFoundError: functions.json"
    assert groups[2].episodes[0].metadata["error"] == "AttributeError: 'NoneType' object has no attribute 'reward'"


def test_a_tool_format_the_template_cannot_show_fails_the_batch(smollm2: ChatTemplate) -> None:
    hermes = ChatTemplate(smollm2.tokenizer, "hermes")
    runner = EpisodeRunner(config(), hermes, lambda _: ScriptedGym())
    with pytest.raises(ChatTemplateError, match="ignores tools"):
        asyncio.run(runner.run_groups([task()], 2, lambda _: ScriptedEngine(hermes, [])))


def test_a_real_simulator_failure_ends_a_real_gym_episode(smollm2: ChatTemplate) -> None:
    """TurtleGym with the real UserSimulator over HTTP: the host answers once, then fails for good."""
    from tests.support.gym_play import sim_for
    from tests.support.openai_server import Fault, OpenAIServer, sequence
    from userrl_megatron.config.schema import GymsConfig
    from userrl_megatron.rollout.episode import gym_factory

    story = {"new_title": "T", "new_surface": "S", "new_bottom": "B", "evaluation": [{"statement": "x", "score": 1.0}]}
    turtle = Task("turtle", "T", [Message("system", "Solve the story."), Message("user", "Go.")], [INTERACT_TOOL])
    turtle.metadata["record"] = story
    engine = ScriptedEngine(smollm2, ["[action] Did she die?", "[action] Was it an accident?"])
    with OpenAIServer(sequence('{"response": "No"}', Fault(500))) as server:
        sim = sim_for(server, max_retries=1)
        runner = EpisodeRunner(config(), smollm2, gym_factory(GymsConfig(), 8, sim))

        async def play() -> Episode:
            try:
                return await runner.run(turtle, engine)
            finally:
                await sim.close()

        episode = asyncio.run(play())
    assert episode.finish_reason == "user_sim_error"
    assert episode.metadata["error"].startswith("user simulator failed after 2 attempts")
    assert [t.action for t in episode.turns] == ["[action] Did she die?", "[action] Was it an accident?"]
    assert "No" in episode.turns[0].feedback and episode.turns[1].reward == 0.0
    assert server.count == 3


def test_each_turn_records_the_weight_version_that_generated_it(qwen3: ChatTemplate) -> None:
    class Pushed(ScriptedEngine):
        async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation:
            reply = await super().generate(input_ids, sampling)
            self.version = str(int(self.version) + 1)  # a weight push lands between two turns
            return reply

    engine = Pushed(qwen3, [call("search", "a"), call("search", "b"), call("answer", "3")], version="4")
    episode = run(qwen3, engine, ScriptedGym([step("x"), step("y"), step("ok", 1.0, done=True)]))
    assert episode.finish_reason == "done"
    assert [t.weight_version for t in episode.turns] == [4, 5, 6]
    assert episode.weight_version == 4  # the episode's own is its oldest turn's
