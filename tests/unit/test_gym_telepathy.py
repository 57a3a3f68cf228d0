"""TelepathyGym over real HTTP: questions, guesses, reward bookkeeping, simulator failures."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

import gyms
from gyms.telepathy.settings import TelepathyGymConfig
from tests.support.gym_play import play_new, sim_for
from tests.support.openai_server import OpenAIServer, sequence, when
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks

RECORD = {
    "id": "entity_900",
    "title": "Kiwi",
    "description": "I am thinking of a fruit.",
    "target_entity": "Kiwi - a small fuzzy brown fruit with bright green flesh",
    "category": "food",
}
YES = '{"thought": "true", "response": "Yes"}'
WRONG = '{"thought": "", "judgment": "No", "feedback": "That is not it."}'
RIGHT = '{"thought": "", "judgment": "Yes", "feedback": "You got it!"}'


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def test_questions_and_guesses(server: OpenAIServer) -> None:
    server.rules = [when("game master", YES), when("judge of a guessing game", sequence(WRONG, RIGHT))]
    results = play_new(
        "telepathy",
        RECORD,
        ["[action] Is it a fruit?", "Is it green inside?", "[answer] apple", "[answer] kiwi", "[answer] kiwi"],
        user_sim=sim_for(server),
    )
    assert [(r.feedback, r.reward, r.done) for r in results] == [
        ("Yes", 0.0, False),
        ("Yes", 0.0, False),
        ("That is not it.", 0.0, False),
        ("You got it!", 1.0, True),
        ("The episode has already ended; no further actions are accepted.", 0.0, True),
    ]
    assert server.count == 4  # nothing is asked after the end
    question = server.requests[1]["messages"]
    assert "Kiwi - a small fuzzy brown fruit" in question[1]["content"]
    assert question[1]["content"].endswith("Player's question: Is it green inside?")  # untagged text kept whole
    assert "Is it a fruit?" not in question[1]["content"]  # stateless, as in UserRL


def test_reset_text_is_userrls() -> None:
    gym = gyms.make_gym("telepathy", RECORD, user_sim=object())
    assert asyncio.run(gym.reset()) == (  # UserRL's reset feedback, byte for byte
        "Welcome to TelepathyGym! I'm thinking of something... Ask me yes/no questions to figure out what it is!"
    )


def test_finish_and_empty_actions_make_no_calls(server: OpenAIServer) -> None:
    results = play_new("telepathy", RECORD, ["[action]", "[finish]"], user_sim=sim_for(server))
    assert [(r.feedback, r.done) for r in results] == [
        ("Please ask a yes-or-no question, or give your guess with [answer].", False),
        ("Game finished.", True),
    ]
    assert server.count == 0


def test_judge_reply_without_judgment_is_a_simulator_error(server: OpenAIServer) -> None:
    server.rules = [when("judge of a guessing game", sequence('{"feedback": "hmm"}', RIGHT))]
    sim = sim_for(server)
    first, second = play_new("telepathy", RECORD, ["[answer] kiwi", "[answer] kiwi"], user_sim=sim)
    assert (first.feedback, first.reward, first.done) == ("Unable to evaluate your guess right now.", 0.0, False)
    assert first.user_sim_error.startswith("simulator reply lacks judgment")
    assert (second.reward, second.done) == (1.0, True)


def test_failed_question_gets_userrls_text(server: OpenAIServer) -> None:
    server.rules = [when("game master", sequence('{"thought": ""}', YES))]
    first, second = play_new(
        "telepathy", RECORD, ["[action] Is it green?", "[action] Is it green?"], user_sim=sim_for(server)
    )
    assert (first.feedback, first.reward, first.user_sim_error is not None) == (
        "Unable to respond to your question right now.",  # UserRL's text, byte for byte
        0.0,
        True,
    )
    assert second.feedback == "Yes"


def test_step_limit_truncates(server: OpenAIServer) -> None:
    server.rules = [when("game master", YES)]
    results = play_new(
        "telepathy", RECORD, ["Is it big?"] * 2, config=TelepathyGymConfig(max_steps=2), user_sim=sim_for(server)
    )
    assert [(r.done, r.truncated) for r in results] == [(False, False), (False, True)]


def test_needs_a_simulator() -> None:
    with pytest.raises(ValueError, match=r"gym telepathy needs a user simulator"):
        gyms.make_gym("telepathy", RECORD)


def test_tasks_from_public_data(shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["telepathy"], "train", cfg), load_tasks(["telepathy"], "test", cfg)
    assert (len(train), len(test)) == (360, 41)
    assert test[0].task_id == "Kiwi" and test[0].metadata["record"]["target_entity"].startswith("Kiwi - a small")
    monkeypatch.setenv("USERRL_DATA_DIR", str(shared_data))  # task ids are looked up in $USERRL_DATA_DIR
    for key in ("kiwi", test[0].metadata["record"]["id"].upper()):  # by title or by id, any case
        assert gyms.make_gym("telepathy", key, user_sim=object()).record == test[0].metadata["record"]


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ('{"thought": "", "judgment": "yes", "feedback": "ok"}', None),  # UserRL counts only "Yes"
        ('{"thought": "", "judgment": " Yes", "feedback": "ok"}', None),
        ('{"thought": "", "judgment": true, "feedback": "ok"}', None),
        ('{"thought": "", "judgment": "Yes"}', "simulator reply lacks feedback"),  # UserRL's parse failed
    ],
)
def test_guess_judgments_are_read_as_userrl_reads_them(server: OpenAIServer, reply: str, error: str | None) -> None:
    server.rules = [when("judge of a guessing game", reply)]
    (result,) = play_new("telepathy", RECORD, ["[answer] kiwi"], user_sim=sim_for(server))
    assert (result.reward, result.done) == (0.0, False)
    if error is None:
        assert result.feedback == "ok" and result.info["correct"] is False
    else:
        assert result.user_sim_error.startswith(error)
