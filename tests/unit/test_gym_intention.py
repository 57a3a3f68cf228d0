"""IntentionGym over real HTTP: coverage rewards, the multi-detail penalty, termination, partial failures."""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import gyms
from gyms.intention.settings import IntentionGymConfig
from tests.support.gym_play import play_new, sim_for
from tests.support.openai_server import Fault, OpenAIServer, sequence, when
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks

DETAILS = [
    {"description": "Trip length", "importance": "3", "inquiry": "How long?", "options": ["3 days", "1 week"]},
    {"description": "Budget", "importance": "2", "inquiry": "Budget?", "options": ["Mid-range"]},
    {"description": "Diet", "importance": "1", "inquiry": "Diet?", "options": ["Vegan"]},
    {"description": "Hotel style", "importance": "1", "inquiry": "Hotel?", "options": ["Boutique"]},
    {"description": "Museums", "importance": "2", "inquiry": "Museums?", "options": ["Yes"]},
]
RECORD = {"id": "i-1", "category": "Travel", "task": "Plan a trip to Paris.", "missing_details": DETAILS}
ANSWER = '{"thought": "", "response": "About a week."}'


def covers(*numbers: object, related: object = True) -> str:
    return json.dumps({"analysis": "", "is_task_related": related, "covered_detail_numbers": list(numbers)})


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def test_rewards_by_importance_and_penalty(server: OpenAIServer) -> None:
    judge = sequence(covers(1), covers(1, 2, 2), covers(3, related=False), covers(7, "x"), covers(2, 1))
    server.rules = [when("You play a person", ANSWER), when("You judge", judge)]
    results = play_new("intention", RECORD, [f"[action] q{i}" for i in range(5)], user_sim=sim_for(server))
    # q0: Trip length (3) 1.0; q1: Budget, Diet (max 2: 0.7 - 0.2); q2: unrelated; q3: out of range / not a number;
    # q4: the remaining Hotel style and Museums (max 2: 0.7 - 0.2), and nothing is left
    assert [r.reward for r in results] == [1.0, 0.5, 0.0, 0.0, 0.5]
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[1].info["covered"] == ["Budget", "Diet"]
    assert [r.feedback for r in results] == ["About a week."] * 5
    assert server.count == 10  # two calls per question


@pytest.mark.parametrize(
    ("judgment", "covered"),
    [
        (covers(1, related="false"), ["Trip length"]),  # a non-empty string is true to UserRL's `if not ...`
        (covers(1, related=0), []),
        (covers(1, related=None), []),
        (json.dumps({"covered_detail_numbers": [1]}), ["Trip length"]),  # no is_task_related: related
        (covers(" 1", "2"), ["Budget"]),  # UserRL's str(i).isdigit() drops " 1"
        (covers(1.0, True, -1, "2"), ["Budget"]),  # floats, booleans and negatives are dropped
        (covers(1, "²"), []),  # "²" is a digit that int() refuses: UserRL's whole parse failed
        (covers(2, 2), ["Budget"]),  # named twice, counted once (UserRL: twice, with the penalty; see README)
    ],
)
def test_coverage_replies_are_read_as_userrl_reads_them(server: OpenAIServer, judgment: str, covered: list) -> None:
    server.rules = [when("You play a person", ANSWER), when("You judge", judgment)]
    (result,) = play_new("intention", RECORD, ["q"], user_sim=sim_for(server))
    assert result.info["covered"] == covered
    assert result.user_sim_error is None


def test_judge_sees_only_remaining_details_and_recent_history(server: OpenAIServer) -> None:
    server.rules = [when("You play a person", ANSWER), when("You judge", sequence(covers(1), covers(), covers()))]
    play_new(
        "intention", RECORD, ["q0", "q1", "q2"], config=IntentionGymConfig(history_turns=1), user_sim=sim_for(server)
    )
    judge_prompts = [r["messages"][1]["content"] for r in server.requests if "You judge" in r["messages"][0]["content"]]
    assert "1. [HIGH] Trip length (a question like: How long?)" in judge_prompts[0]
    assert "Trip length" not in judge_prompts[2] and "1. [MEDIUM] Budget" in judge_prompts[2]
    assert "Assistant: q1\nUser: About a week." in judge_prompts[2] and "Assistant: q0" not in judge_prompts[2]
    user_prompts = [r["messages"][1]["content"] for r in server.requests if "You play" in r["messages"][0]["content"]]
    assert "- Trip length (options you consider: 3 days, 1 week)" in user_prompts[2]  # the user knows all its needs


def test_multi_detail_penalty_floors_at_zero(server: OpenAIServer) -> None:
    server.rules = [when("You play a person", ANSWER), when("You judge", covers(3, 4))]
    (result,) = play_new(
        "intention", RECORD, ["q"], config=IntentionGymConfig(multi_detail_penalty=0.5), user_sim=sim_for(server)
    )
    assert result.reward == 0.0 and result.info["covered"] == ["Diet", "Hotel style"]


def test_one_failed_call_scores_nothing_and_loses_nothing(server: OpenAIServer) -> None:
    server.rules = [when("You play a person", sequence(Fault(500), ANSWER)), when("You judge", covers(1))]
    first, second = play_new("intention", RECORD, ["q0", "q1"], user_sim=sim_for(server, max_retries=0))
    assert (first.reward, first.user_sim_error.startswith("user simulator failed after 1 attempts")) == (
        0.0,
        True,
    )
    assert first.feedback == "Sorry, I'm not sure how to answer that right now. Could you ask again?"
    assert (second.reward, second.info["covered"]) == (1.0, ["Trip length"])  # detail 1 was still remaining


def test_reset_text_is_userrls() -> None:
    gym = gyms.make_gym("intention", RECORD, user_sim=object())
    assert asyncio.run(gym.reset()) == (  # UserRL's reset feedback, byte for byte
        "Welcome to IntentionGym! Here's a vague task that needs clarification: 'Plan a trip to Paris.'. "
        "Ask me questions to understand what exactly I need help with!"
    )


def test_the_users_answer_is_shown_as_written(server: OpenAIServer) -> None:
    answer = json.dumps({"thought": "", "response": "  About a week.\n"})
    server.rules = [when("You play a person", answer), when("You judge", covers())]
    (result,) = play_new("intention", RECORD, ["[action] How long?"], user_sim=sim_for(server))
    assert result.feedback == "  About a week.\n"  # UserRL does not strip the user's response


def test_finish_reports_coverage(server: OpenAIServer) -> None:
    server.rules = [when("You play a person", ANSWER), when("You judge", covers(1))]
    results = play_new("intention", RECORD, ["q", "[finish]"], user_sim=sim_for(server))
    assert (results[1].feedback, results[1].done) == ("Session ended. You covered 1/5 missing details.", True)


def test_tasks_from_public_data(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["intention"], "train", cfg), load_tasks(["intention"], "test", cfg)
    assert (len(train), len(test)) == (380, 40)
    record = test[0].metadata["record"]
    assert record["id"] == "06c2b5dd-7750-4cb6-8aad-1ff6554b98fb"
    assert test[0].metadata["ground_truth"] == ", ".join(d["description"] for d in record["missing_details"])
