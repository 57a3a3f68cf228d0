"""TravelGym over real HTTP: search judging and failures, elicitation (asked and volunteered), recommendations,
termination, and the UserRL bugs that are fixed."""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gyms.travel.generator import generate_scenario
from gyms.travel.settings import TravelGymConfig
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


# UserRL's observation texts (travelgym/env/prompts.py at cf55a30), byte for byte.
BACKEND = "Currently the searching backend is experiencing some issues. Please try again later."
REFINE = (
    "Please refine your search request to 1. align with user's need, 2. make only one request attempt at a time, and "
    "3. cover and only cover correct search request arguments."
)
RECORDED_ONE = (
    " Your choice is recorded and do not choose options of this travel aspect again. Please continue your interaction "
    "and reasoning focusing on other travel aspects."
)
RECORDED = (
    " Your choice is recorded and do not choose these options again. Please continue your interaction and reasoning."
)
CANNOT_REPLY = "I'm sorry, I'm not sure how to respond to your latest utterance right now. Please try again."


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def run(server: OpenAIServer, actions: list[str], retries: int = 2, **config: Any) -> list:
    sim = sim_for(server, max_retries=retries)
    return play_new("travel", SCENARIO_ID, actions, config=TravelGymConfig(**config), user_sim=sim)


def test_search_rewards_repeats_mismatches_and_planned_failures(server: OpenAIServer) -> None:
    judge = sequence(
        aligned("Hotel"),
        aligned("hotel"),
        '{"alignment_judgement": "False"}',
        aligned("restaurant"),
        '{"alignment_judgement": "N/A"}',
        '{"alignment_judgement": "True"}',
    )
    server.rules = [when("You check search requests", judge)]
    actions = [f"[search] q{i}" for i in range(8)]
    results = run(server, actions, search_correct_reward=0.2, search_failure_interval=7)
    assert [r.reward for r in results] == [0.2] + [0.0] * 7
    schema = """Each hotel option includes:
    - name: Hotel name
    - city: City of the hotel
    - check_in: Check-in date
    - check_out: Check-out date
    - room: Room type
    - cost: Cost of the room for the entire stay in USD
    - rating: Hotel rating on a scale of 0-10
    - distance_to_center_km: Distance to the city center in kilometers
    - amenities: Available facilities free of charge
    - service: Additional services with costs"""
    assert results[0].feedback == (
        "You have provided the correct search request arguments.\n\n"
        + f"{schema}\n\nHere are all the options for <hotel>:\n"
        + "\n".join(json.dumps(option) for option in HOTEL["options"])
    )
    assert results[1].feedback == (
        "You have provided the correct search request arguments. However, you have already got the search results for "
        "<hotel> in previous search attempts. Please directly refer to the previous search results."
    )
    assert results[2].feedback == (
        "There's something wrong within your searching request, or the arguments in your request is not accurate. "
        + REFINE
    )
    # "True" for an aspect not in the trip (or for none): UserRL's failed assertion answers as a backend failure
    assert results[3].feedback == BACKEND
    assert results[3].info["search_aspect_not_in_trip"] == "restaurant"
    assert results[3].user_sim_error is None
    assert results[4].feedback == (
        "You have provided the correct search request arguments. However, the arguments are not related to any of the "
        "ground truth search arguments. " + REFINE
    )
    assert (results[5].feedback, results[5].info["search_aspect_not_in_trip"]) == (BACKEND, "")
    assert results[6].feedback == BACKEND
    assert results[6].info["search_failure"] is True
    assert server.count == 7  # the 7th search never reached the judge
    arguments = server.requests[0]["messages"][1]["content"]
    assert (
        json.dumps(FLIGHT["arguments"], indent=2) in arguments and json.dumps(HOTEL["arguments"], indent=2) in arguments
    )


@pytest.mark.parametrize("verdict", ["true", True, "TRUE", " True"])
def test_a_search_verdict_other_than_userrls_strings_fails_the_search(server: OpenAIServer, verdict: object) -> None:
    reply = json.dumps({"alignment_judgement": verdict, "alignment_aspect": "hotel"})
    server.rules = [when("You check search requests", reply)]
    (result,) = run(server, ["[search] hotels in Rome"], retries=0)
    assert (result.feedback, result.reward) == (BACKEND, 0.0)
    assert result.user_sim_error == f"search judge verdict {verdict!r} is not True, False or N/A"


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
        "This is a good question. However, I do not have specific preference in the aspect you ask about yet (or maybe "
        "I have already elicited that to you before). You may continue to ask me about other detailed and specific "
        "preferences.",
        "Your question is too vague and general, and I am not sure how to respond to it. Please ask me about some "
        "specific aspects of my preferences, in a more detailed and concrete way, so that I can provide you with a "
        "more accurate response.",
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
        "Your chosen options contain the correct option, but not the best option." + RECORDED_ONE
    )
    assert results[1].feedback == (
        "You have already recommended an option with the same initial 'F'. You are allowed to recommend only one "
        "option per traveling aspect. Please focus on the search, user preference, and option recommendation on "
        "other traveling aspects now."
    )
    assert results[2].feedback == (
        f"Invalid option ID format detected for '{wrong.lower()}'. Expected format: H1, F12, C4, etc."
    )
    assert (
        results[3].feedback == "Your chosen options do not contain any of the best or correct options." + RECORDED_ONE
    )
    assert [r.done for r in results[:4]] == [False, False, False, True]  # one choice per aspect (UserRL: no end)
    assert server.count == 0


def test_all_best_options_end_the_episode_without_one_choice(server: OpenAIServer) -> None:
    wrong = next(o["id"] for o in FLIGHT["options"] if o["id"] not in FLIGHT["correct_ids"])
    actions = [f"[answer] {wrong}", f"[answer] {FLIGHT['best_id']}", f"[answer] {HOTEL['best_id']}"]
    results = run(server, actions, one_choice_per_aspect=False)
    assert [(r.reward, r.done) for r in results] == [(0.0, False), (1.0, False), (1.0, True)]
    assert [r.feedback for r in results] == [
        "Your chosen options do not contain any of the best or correct options." + RECORDED,
        "Your chosen options contain the best option!" + RECORDED,
        "Your chosen options contain the best option!" + RECORDED,
    ]


BEST = "Your chosen options contain the best option!"
CORRECT = "Your chosen options contain the correct option, but not the best option."
WRONG = "Your chosen options do not contain any of the best or correct options."


def test_a_repeated_recommendation_pays_nothing_without_one_choice(server: OpenAIServer) -> None:
    # UserRL (prompts.py and prompt_async.py, [answer]) removes a scored id from its best and correct lists, so
    # the same id again is a wrong choice (0, its text); another correct id of the same aspect still pays.
    first, second = [i for i in FLIGHT["correct_ids"] if i != FLIGHT["best_id"]][:2]
    actions = [first, first, second, FLIGHT["best_id"], FLIGHT["best_id"], second, HOTEL["best_id"]]
    results = run(server, [f"[answer] {a}" for a in actions], one_choice_per_aspect=False)
    assert [(r.feedback, r.reward, r.done) for r in results] == [
        (CORRECT + RECORDED, 0.8, False),
        (WRONG + RECORDED, 0.0, False),
        (CORRECT + RECORDED, 0.8, False),
        (BEST + RECORDED, 1.0, False),
        (WRONG + RECORDED, 0.0, False),
        (WRONG + RECORDED, 0.0, False),
        (BEST + RECORDED, 1.0, True),  # every best option found, the repeats changed nothing
    ]
    aspects = ["flight"] * 6 + ["hotel"]
    assert [(r.info["choice"], r.info["aspect"]) for r in results] == list(zip(actions, aspects, strict=True))
    assert server.count == 0


def test_a_repeated_recommendation_with_one_choice_per_aspect_is_refused(server: OpenAIServer) -> None:
    other = next(i for i in FLIGHT["correct_ids"] if i != FLIGHT["best_id"])
    results = run(server, [f"[answer] {other}", f"[answer] {other}", f"[answer] {HOTEL['best_id']}"])
    assert [(r.reward, r.done) for r in results] == [(0.8, False), (0.0, False), (1.0, True)]
    assert results[1].feedback.startswith("You have already recommended an option with the same initial 'F'.")


def test_best_option_with_one_choice_per_aspect(server: OpenAIServer) -> None:
    (result,) = run(server, [f"[answer] {HOTEL['best_id']}"])
    assert (result.feedback, result.reward) == ("Your chosen options contain the best option!" + RECORDED_ONE, 1.0)


@pytest.mark.parametrize(
    ("answer", "feedback"),
    [
        # UserRL's sync path refuses several ids with this text; its async path summed them
        ("[answer] F1, H2", "You have chosen multiple options. Please choose only one option at a time."),
        ("[answer] H1,", "You have chosen multiple options. Please choose only one option at a time."),
        ("[answer]", "Invalid option ID format detected for ''. Expected format: H1, F12, C4, etc."),
        ("[answer] hotel one", "Invalid option ID format detected for 'hotel one'. Expected format: H1, F12, C4, etc."),
        ("[answer] h1", "Invalid option ID format detected for 'h1'. Expected format: H1, F12, C4, etc."),
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
    assert [bool(r.user_sim_error) for r in results] == [True, False, True, False]
    assert results[0].feedback == BACKEND
    assert results[2].feedback == CANNOT_REPLY
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 0.8]


def test_finish_summary(server: OpenAIServer) -> None:
    results = run(server, [f"[answer] {HOTEL['best_id']}", "[finish]"])
    # the hotel's 3 hidden preferences are dropped with its choice: 0 of the flight's 2 were uncovered
    assert (results[1].feedback, results[1].reward, results[1].done) == (
        "Session ended. You elicited 0/2 preferences. Final elicitation ratio: 0.00%",
        0.0,
        True,
    )


def test_finish_summary_counts_asked_and_volunteered_preferences(server: OpenAIServer) -> None:
    server.rules = [
        when("You classify", sequence(typed("2", P[0]), typed("1"), typed("1"), typed("1"), typed("1"))),
        when("agent just asked", said("Morning flights please.")),
        when("has not asked about what matters", said("By the way...")),
        when("Reply briefly", said("Ok.")),
    ]
    results = run(server, [f"[action] u{i}" for i in range(5)] + ["[finish]"], elicitation_interval=3)
    assert [bool(r.info.get("elicited") or r.info.get("volunteered")) for r in results[:5]] == [1, 0, 0, 0, 1]
    assert results[5].feedback == "Session ended. You elicited 2/5 preferences. Final elicitation ratio: 40.00%"


def test_a_failed_reply_is_userrls_canned_text(server: OpenAIServer) -> None:
    server.rules = [when("You classify", typed("2", P[0])), when("agent just asked", "no json")]
    (result,) = run(server, ["[action] Which airline?"], retries=0)
    assert (result.feedback, result.reward, bool(result.user_sim_error)) == (CANNOT_REPLY, 0.0, True)
