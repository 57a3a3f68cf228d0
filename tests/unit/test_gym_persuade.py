"""PersuadeGym over real HTTP: stance rewards under both baselines, termination, malformed stances."""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import gyms
from gyms.persuade.settings import PersuadeGymConfig
from tests.support.gym_play import play_new, sim_for
from tests.support.openai_server import OpenAIServer, sequence, when
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks

RECORD = {"id": "ABCDEFGHIJKL", "claim": "Cats are better than dogs.", "argument": "Cats are independent."}


def said(stance: str, response: str = "I see.") -> str:
    return json.dumps({"thought": "", "response": response, "stance": stance})


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


@pytest.mark.parametrize(
    ("baseline", "rewards"),
    [
        ("best", [0.333333, 0.0, 0.333333, 0.0, 0.333333]),
        ("previous", [0.333333, 0.0, 0.5, 0.0, 0.5]),  # UserRL: oscillation pays twice for the same ground
    ],
)
def test_rewards_by_baseline(server: OpenAIServer, baseline: str, rewards: list[float]) -> None:
    stances = ["Partly Agree", "Agree", "Partly Disagree", "Neutral", "Strongly Disagree"]
    server.rules = [when("debate", sequence(*(said(s) for s in stances)))]
    results = play_new(
        "persuade",
        RECORD,
        [f"[answer] argument {i}" for i in range(5)],
        config=PersuadeGymConfig(reward_baseline=baseline),
        user_sim=sim_for(server),
    )
    assert [r.reward for r in results] == rewards
    assert [r.done for r in results] == [False] * 4 + [True]
    assert [r.info["stance"] for r in results] == stances


def test_a_full_swing_pays_one_and_history_is_shown(server: OpenAIServer) -> None:
    server.rules = [when("debate", sequence(said("Strongly Agree", "No way."), said("Strongly Disagree", "Fine!")))]
    results = play_new("persuade", RECORD, ["[answer] Dogs are loyal.", "Dogs save lives."], user_sim=sim_for(server))
    assert [(r.feedback, r.reward, r.done) for r in results] == [("No way.", 0.0, False), ("Fine!", 1.0, True)]
    second = server.requests[1]["messages"][1]["content"]
    assert "Turn 1:\nPersuader: Dogs are loyal.\nYou: No way." in second
    assert "Your stance so far: Strongly Agree" in second and second.endswith("Dogs save lives.")
    assert "Cats are independent." in second


def test_unknown_stance_is_a_simulator_error_and_changes_nothing(server: OpenAIServer) -> None:
    server.rules = [when("debate", sequence(said("Somewhat Agree"), said("Neutral")))]
    first, second = play_new("persuade", RECORD, ["[answer] a", "[answer] b"], user_sim=sim_for(server))
    assert (first.feedback, first.reward) == ("I'm having trouble understanding your argument right now.", 0.0)
    assert first.user_sim_error == "persona stance 'Somewhat Agree' is not one of the 7 stances"
    assert second.reward == 0.5  # measured from Strongly Agree: the bad reply did not move the stance


@pytest.mark.parametrize("stance", ["strongly disagree", "Strongly  Disagree", " Strongly Disagree", "DISAGREE"])
def test_a_stance_must_be_spelled_exactly_as_in_userrl(server: OpenAIServer, stance: str) -> None:
    server.rules = [when("debate", said(stance))]
    (result,) = play_new("persuade", RECORD, ["[answer] a"], user_sim=sim_for(server))
    assert (result.reward, result.done) == (0.0, False)
    assert result.user_sim_error == f"persona stance {stance!r} is not one of the 7 stances"


def test_reset_text_is_userrls() -> None:
    gym = gyms.make_gym("persuade", RECORD, user_sim=object())
    assert asyncio.run(gym.reset()) == (  # UserRL's reset feedback, byte for byte
        "Welcome to PersuadeGym! I currently strongly agree with this statement: 'Cats are better than dogs.'. "
        "Here's my reasoning: Cats are independent. Try to change my mind!"
    )


def test_the_personas_reply_is_shown_as_written(server: OpenAIServer) -> None:
    server.rules = [when("debate", said("Agree", " Hm, fair point.\n"))]
    (result,) = play_new("persuade", RECORD, ["[answer] Dogs are loyal."], user_sim=sim_for(server))
    assert (result.feedback, result.reward) == (" Hm, fair point.\n", 0.166667)  # UserRL does not strip it


def test_finish_and_empty(server: OpenAIServer) -> None:
    results = play_new("persuade", RECORD, ["[answer]  ", "[finish]"], user_sim=sim_for(server))
    assert [(r.feedback, r.done) for r in results] == [
        ("Please make an argument.", False),
        ("Conversation ended.", True),
    ]
    assert server.count == 0


def test_records_are_recovered_from_the_parquet_rows(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["persuade"], "train", cfg), load_tasks(["persuade"], "test", cfg)
    assert (len(train), len(test)) == (378, 42)
    record = test[0].metadata["record"]
    assert (
        record["id"] == "YV3MRNMKH6MV"
        and record["claim"] == "Anti-aging therapies should be made available even if expensive"
    )
    assert record["argument"].startswith("While anti-aging therapies would likely be expensive")
    assert len({t.metadata["record"]["claim"] for t in train + test}) == 61
