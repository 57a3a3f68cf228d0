"""TravelGym over real HTTP: search judging and failures, elicitation (asked and volunteered), recommendations,
termination, and the UserRL bugs that are fixed."""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gyms.config import TravelGymConfig
from gyms.travel.generator import generate_scenario
from tests.support.gym_play import play_new, sim_for
from tests.support.openai_server import OpenAIServer, sequence, when

SCENARIO_ID = "flight:2-5|hotel:3-6"
SCENARIO = generate_scenario(SCENARIO_ID)
FLIGHT, HOTEL = SCENARIO["aspects"]["flight"], SCENARIO["aspects"]["hotel"]
P = [p["id"] for p in SCENARIO["preferences"]]  # P1, P2 flight; P3..P5 hotel


def aligned(aspect: str) -> str:
    return json.dumps({"alignment_judgement": "True", "alignment_aspect": aspect})


def typed(kind: str, pref: str = "") -> str:
    return json.dumps({"type": kind, "preference_id": pref})


def said(text: str) -> str:
    return json.dumps({"thought": "", "response": text})


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def run(server: OpenAIServer, actions: list[str], retries: int = 2, **config: Any) -> list:
    sim = sim_for(server, max_retries=retries)
    return play_new("travel", SCENARIO_ID, actions, config=TravelGymConfig(**config), user_sim=sim)


def test_search_rewards_repeats_mismatches_and_planned_failures(server: OpenAIServer) -> None:
    judge = sequence(aligned("Hotel"), aligned("hotel"), '{"alignment_judgement": "False"}', aligned("restaurant"))
    server.rules = [when("You check search requests", judge)]
    results = run(server, [f"[search] q{i}" for i in range(5)], search_correct_reward=0.2)
    assert [r.reward for r in results] == [0.2, 0.0, 0.0, 0.0, 0.0]
    first = results[0].feedback.split("\n")
    assert first[0] == "Your search request is correct."
    assert first[4] == "All options for <hotel>:"
    assert [json.loads(line) for line in first[5:]] == HOTEL["options"]
    assert (
        results[1].feedback == "Your search request is correct, but you already have the options for <hotel>: use them."
    )
    assert results[2].feedback.startswith("Your search request could not be matched.")
    assert results[3].feedback.startswith("Your search request could not be matched.")  # not an aspect of this trip
    assert results[4].feedback == "The search backend is having problems at the moment. Please try again later."
    assert results[4].info["search_failure"] is True
    assert server.count == 4  # the 5th search never reached the judge
    arguments = server.requests[0]["messages"][1]["content"]
    assert (
        json.dumps(FLIGHT["arguments"], indent=2) in arguments and json.dumps(HOTEL["arguments"], indent=2) in arguments
    )


@pytest.mark.parametrize("verdict", ["true", True, "TRUE", " True"])
def test_a_search_verdict_other_than_userrls_strings_fails_the_search(server: OpenAIServer, verdict: object) -> None:
    reply = json.dumps({"alignment_judgement": verdict, "alignment_aspect": "hotel"})
    server.rules = [when("You check search requests", reply)]
    (result,) = run(server, ["[search] hotels in Rome"], retries=0)
    assert (result.feedback, result.reward) == (
        "The search backend is having problems at the moment. Please try again later.",
        0.0,
    )
    assert result.info["user_sim_error"] == f"search judge verdict {verdict!r} is not True, False or N/A"


def test_elicitation_types_and_volunteered_preference(server: OpenAIServer) -> None:
    judge = sequence(typed("2", P[2]), typed("2", P[2]), typed("3"), typed("4"), typed("1"), typed("7"))
    server.rules = [
        when("You classify", judge),
        when("agent just asked", said("I like walking everywhere.")),
        when("has not asked about what matters", said("By the way, flights...")),
        when("Reply briefly", said("Sure.")),
    ]
    results = run(server, [f"[action] u{i}" for i in range(7)], elicitation_interval=3)
    assert [r.reward for r in results] == [0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [r.feedback for r in results] == [
        "I like walking everywhere.",
        "Sure.",  # P3 is no longer hidden: the judge's id is not valid any more -> a natural reply
        "Good question, but I don't have a particular preference about that (or I already told you). Feel free to ask "
        "me about other specifics.",
        "That's a bit too general for me to answer. Could you ask me about something more specific?",
        "By the way, flights...",  # 4 off-preference utterances: the traveller volunteers one (UserRL crashed here)
        "Sure.",
        "Sure.",
    ]
    assert results[0].info["elicited"] == P[2]
    volunteered = results[4].info["volunteered"]
    assert volunteered in P and volunteered != P[2]
    judged = [r["messages"][1]["content"] for r in server.requests if "You classify" in r["messages"][0]["content"]]
    assert f"{P[2]} (hotel)" in judged[0] and f"{P[2]} (hotel)" not in judged[1]
    assert f"{volunteered} (" not in judged[5]
    assert "Agent: u0\nUser: I like walking everywhere." in judged[1]


def test_recommendations_and_one_choice_termination(server: OpenAIServer) -> None:
    other = next(i for i in FLIGHT["correct_ids"] if i != FLIGHT["best_id"])
    wrong = next(o["id"] for o in HOTEL["options"] if o["id"] not in HOTEL["correct_ids"])
    actions = [
        f"[answer] {other}",
        f"[answer] {FLIGHT['best_id']}",
        f"[answer] {wrong.lower()}",
        f"[answer] {wrong}",
        "[answer] H1",
    ]
    results = run(server, actions)
    assert [r.reward for r in results] == [0.8, 0.0, 0.0, 0.0, 0.0]
    assert results[0].feedback == (
        "Your choice is a correct option, but not the best. Your choice is recorded: do not recommend another option "
        "for this aspect."
    )
    assert results[1].feedback.startswith("You have already recommended a flight option")
    assert results[2].feedback == f"'{wrong.lower()}' is not an option id. Option ids look like H1, F12 or C4."
    assert results[3].feedback.startswith("Your choice is neither the best nor a correct option.")
    assert [r.done for r in results[:4]] == [False, False, False, True]  # one choice per aspect (UserRL: no end)
    assert server.count == 0


def test_all_best_options_end_the_episode_without_one_choice(server: OpenAIServer) -> None:
    wrong = next(o["id"] for o in FLIGHT["options"] if o["id"] not in FLIGHT["correct_ids"])
    actions = [f"[answer] {wrong}", f"[answer] {FLIGHT['best_id']}", f"[answer] {HOTEL['best_id']}"]
    results = run(server, actions, one_choice_per_aspect=False)
    assert [(r.reward, r.done) for r in results] == [(0.0, False), (1.0, False), (1.0, True)]
    assert results[1].feedback == "Your choice is the best option!"


@pytest.mark.parametrize(
    ("answer", "feedback"),
    [
        ("[answer] F1, H2", "Please recommend exactly one option id at a time, e.g. H1."),  # UserRL summed both
        ("[answer]", "Please recommend exactly one option id at a time, e.g. H1."),
        ("[answer] hotel one", "'hotel one' is not an option id. Option ids look like H1, F12 or C4."),
        ("[answer] h1", "'h1' is not an option id. Option ids look like H1, F12 or C4."),  # UserRL: upper case only
        ("[answer] R2", "This trip has no restaurant to book."),
        ("[answer] C2", "This trip has no rental car to book."),
        ("hello", "Your response format is wrong and cannot be parsed properly."),
        ("[action]", "Please say something to the user."),
    ],
)
def test_bad_recommendations_are_refused(server: OpenAIServer, answer: str, feedback: str) -> None:
    (result,) = run(server, [answer])
    assert (result.feedback, result.reward, result.done) == (feedback, 0.0, False)


def test_choosing_an_aspect_drops_its_hidden_preferences(server: OpenAIServer) -> None:
    server.rules = [when("You classify", typed("1")), when("Reply briefly", said("Ok."))]
    run(server, [f"[answer] {HOTEL['best_id']}", "[action] hi"])
    listed = server.requests[0]["messages"][1]["content"].split("Hidden preferences not yet uncovered:\n")[1]
    assert listed == "\n".join(f"{p['id']} (flight): {p['preference']}" for p in SCENARIO["preferences"][:2])


def test_judge_failures_are_marked_and_change_nothing(server: OpenAIServer) -> None:
    server.rules = [
        when("You check search requests", sequence('{"verdict": "yes"}', aligned("flight"))),
        when("You classify", sequence("not json at all", typed("2", P[0]))),
        when("agent just asked", said("Morning flights please.")),
    ]
    results = run(server, ["[search] q", "[search] q", "[action] a", "[action] a"], retries=0)
    assert [bool(r.info.get("user_sim_error")) for r in results] == [True, False, True, False]
    assert results[0].feedback == "The search backend is having problems at the moment. Please try again later."
    assert results[2].feedback == "Sorry, I'm not sure how to respond to that right now. Could you say it again?"
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.8]


def test_finish_summary(server: OpenAIServer) -> None:
    results = run(server, [f"[answer] {HOTEL['best_id']}", "[finish]"])
    assert (results[1].feedback, results[1].done) == (
        "Session ended. You found the best option for 1 of 2 aspects.",
        True,
    )
