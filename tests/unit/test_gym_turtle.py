"""TurtleGym over real HTTP: weighted rubric scores, improvement rewards, the success threshold, bad grades."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyms.turtle.settings import TurtleGymConfig
from tests.support.gym_play import play_new, sim_for
from tests.support.openai_server import OpenAIServer, sequence, when
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks

RECORD = {
    "new_title": "The Broken Nails",
    "new_surface": "Her nails were found broken on the floor.",
    "new_bottom": "She was left for dead, woke up hanged, clawed at the rope and died.",
    "evaluation": [
        {"statement": "Someone left her for dead", "score": 0.2},
        {"statement": "She was hanged", "score": 0.3},
        {"statement": "She clawed at the rope", "score": 0.5},
    ],
}


def grades(*scores: float) -> str:
    rows = [{"statement": f"s{i}", "thought": "", "score": s} for i, s in enumerate(scores)]
    return json.dumps({"scores": rows, "feedback": "judge feedback is not shown"})


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def test_rewards_are_improvements_of_the_weighted_score(server: OpenAIServer) -> None:
    server.rules = [
        when("You host", '{"thought": "", "response": "No"}'),
        when("You grade", sequence(grades(1, 0, 0.5), grades(0, 0, 0.5), grades(1, 1, 0.5), grades(1, 1, 1))),
    ]
    actions = ["[action] Was she murdered?", "[answer] s1", "[answer] s2", "[answer] s3", "[answer] s4"]
    results = play_new("turtle", RECORD, actions, user_sim=sim_for(server))
    assert [r.reward for r in results] == [0.0, 0.45, 0.0, 0.3, 0.25]  # scores 0.45, 0.25, 0.75, 1.0
    assert [r.info.get("score") for r in results[1:]] == [0.45, 0.25, 0.75, 1.0]
    assert [r.done for r in results] == [False, False, False, False, True]
    assert results[0].feedback == "No"
    assert results[1].feedback == (  # UserRL's text, byte for byte
        "Here's the evaluation points that your story effectively covers:\nSomeone left her for dead: Covered\n"
        "There might be more hidden twists that you haven't covered. Try to continue ask related questions and "
        "answer with creativity."
    )
    assert results[2].feedback == "Your answer does not effectively cover any evaluation points."
    assert results[3].feedback == (  # 0.5 is not "covered"; each covered statement on its own line
        "Here's the evaluation points that your story effectively covers:\nSomeone left her for dead: Covered\n"
        "She was hanged: Covered\nThere might be more hidden twists that you haven't covered. Try to continue ask "
        "related questions and answer with creativity."
    )
    grading = server.requests[1]["messages"][1]["content"]
    assert grading.endswith(
        "Rubric statements:\n1. Someone left her for dead\n2. She was hanged\n3. She clawed at the rope"
    )
    assert "0.2" not in grading  # the weights stay hidden from the grader


def test_lower_success_threshold_ends_earlier(server: OpenAIServer) -> None:
    server.rules = [when("You grade", grades(1, 1, 0.5))]
    (result,) = play_new(
        "turtle", RECORD, ["[answer] story"], config=TurtleGymConfig(success_threshold=0.7), user_sim=sim_for(server)
    )
    assert (result.reward, result.done) == (0.75, True)


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (grades(1, 1), "grader returned 2 scores for 3 rubric statements"),
        (grades(1, 0.7, 0), "grader score {'statement': 's1', 'thought': '', 'score': 0.7} is not one of 0, 0.5, 1"),
        ('{"scores": "all good"}', "grader returned str scores for 3 rubric statements"),
        ('{"feedback": "nice"}', "simulator reply lacks scores"),
        # UserRL multiplies each entry's "score" by its weight: a string, or a bare number, fails the reply
        (grades(1, "0.5", 0), "grader score {'statement': 's1', 'thought': '', 'score': '0.5'} is not one of"),
        ('{"scores": [1, 0.5, 0]}', "grader score 1 is not one of 0, 0.5, 1"),
        (grades(1, True, 0), "grader score {'statement': 's1', 'thought': '', 'score': True} is not one of"),
    ],
)
def test_malformed_grades_are_simulator_errors(server: OpenAIServer, reply: str, problem: str) -> None:
    server.rules = [when("You grade", sequence(reply, grades(0.5, 0, 0)))]
    first, second = play_new("turtle", RECORD, ["[answer] a", "[answer] b"], user_sim=sim_for(server))
    assert (first.feedback, first.reward) == ("Feedback not available currently. Please try again.", 0.0)
    assert first.user_sim_error.startswith(problem)
    assert second.reward == 0.1  # the failed grade did not move the best score


def test_a_perfect_story_ends_the_episode_whatever_the_float_sum(server: OpenAIServer) -> None:
    """Weights 0.7 + 0.2 + 0.1 sum to 0.9999999999999999 in floats: UserRL's threshold 1.0 never ended the
    episode; the score is rounded to 6 places here (a deliberate fix, listed in gyms/README.md)."""
    weights = [0.7, 0.2, 0.1]
    assert sum(weights) == 0.9999999999999999
    record = {**RECORD, "evaluation": [{"statement": f"s{i}", "score": w} for i, w in enumerate(weights)]}
    server.rules = [when("You grade", grades(1, 1, 1))]
    (result,) = play_new("turtle", record, ["[answer] story"], user_sim=sim_for(server))
    assert (result.reward, result.done, result.info["score"]) == (1.0, True, 1.0)


def test_finish(server: OpenAIServer) -> None:
    (result,) = play_new("turtle", RECORD, ["[finish]"], user_sim=sim_for(server))
    assert (result.feedback, result.done, server.count) == ("", True, 0)  # UserRL's [finish] text is empty


def test_question_reply_is_the_judge_word_as_written(server: OpenAIServer) -> None:
    server.rules = [when("You host", '{"thought": "", "response": "Maybe "}')]
    (result,) = play_new("turtle", RECORD, ["[action] Was it raining?"], user_sim=sim_for(server))
    assert (result.feedback, result.reward) == ("Maybe ", 0.0)  # UserRL returns the response field unchanged


def test_statements_are_listed_as_userrl_lists_them(server: OpenAIServer) -> None:
    """UserRL joins "<statement>: Covered" lines and strips the whole list (not each line)."""
    record = {**RECORD, "evaluation": [{"statement": " Padded ", "score": 0.5}, {"statement": "x ", "score": 0.5}]}
    server.rules = [when("You grade", grades(1, 1))]
    (result,) = play_new("turtle", record, ["[answer] story"], user_sim=sim_for(server))
    assert result.feedback.split("\n")[:3] == [
        "Here's the evaluation points that your story effectively covers:",
        "Padded : Covered",
        "x : Covered",
    ]


def test_reset_feedback_is_userrl_s() -> None:
    import asyncio

    from gyms.turtle.env import TurtleGym

    gym = TurtleGym(RECORD, user_sim=object())
    assert asyncio.run(gym.reset()) == "Welcome to the Turtle Soup Gym. Choose your action."


def test_tasks_from_public_data(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    train, test = load_tasks(["turtle"], "train", cfg), load_tasks(["turtle"], "test", cfg)
    assert (len(train), len(test)) == (423, 48)
    task = test[0]
    assert task.task_id == "The Broken Nails"
    weights = [c["score"] for c in task.metadata["record"]["evaluation"]]
    assert sum(weights) == pytest.approx(1.0)
