"""Documented differences: one predicate per row of gyms/README.md's difference table that a scripted run can
reach; a difference none of them claims is undocumented."""

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from .harness import FAIL, TAGS, Outcome

# --------------------------------------------------------------------------------------------------------------
# Documented differences: one predicate per row of gyms/README.md's table that a scripted run can reach.


@dataclasses.dataclass
class Diff:
    gym: str
    case: int
    task: str
    step: int
    kind: str  # observation | reward | ending | flags | error
    action: str
    userrl: Any
    ours: Any
    notes: list[str]
    replies: list[str]
    documented: str = ""  # the README row it falls under ("" = undocumented)


def _exact_tag(action: str, strip: bool) -> str | None:
    text = action.strip() if strip else action
    for tag in TAGS:
        if text.startswith(tag):
            return tag[1:-1]
    return None


def doc_flags(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.kind == "flags" and u.ended == o.ended


def _userrl_tag(gym: str, action: str) -> str | None:
    """The tag UserRL's `gym` reads in `action`: case-sensitive `startswith`, on the stripped action except in
    Persuade, Telepathy and Turtle; Intention and Travel read `[finish]` in any case."""
    text = action if gym in ("persuade", "telepathy", "turtle") else action.strip()
    if gym in ("intention", "travel") and text.lower().startswith("[finish]"):
        return "finish"
    return _exact_tag(text, False)


def doc_tag_parsing(d: Diff, u: Outcome, o: Outcome) -> bool:
    from gyms.base import parse_action

    varied = {"tag_case", "tag_space", "untagged"} & set(d.notes)
    return bool(varied) and parse_action(d.action)[0] != _userrl_tag(d.gym, d.action)


def doc_untagged_first8(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym in ("telepathy", "turtle") and _exact_tag(d.action, False) in (None, "search")


def doc_empty_action(d: Diff, u: Outcome, o: Outcome) -> bool:
    tag = _exact_tag(d.action, True)
    payload = d.action.strip()[8:].strip() if tag else d.action.strip()
    if payload:
        return False
    if d.gym in ("intention", "persuade"):  # an empty question or argument, whatever its tag (or none)
        return tag != "finish"
    return (d.gym in ("telepathy", "turtle") and tag in ("action", "answer")) or (d.gym == "travel" and tag == "action")


def doc_sim_failure(d: Diff, u: Outcome, o: Outcome) -> bool:
    from gyms.reply_json import extract_json_object

    def broken(text: str) -> bool:
        return text == FAIL or extract_json_object(text) is None

    return any(broken(r) for r in d.replies) or "bad_grades" in d.notes or "missing_field" in d.notes


def _userrl_parses(gym: str, text: str) -> bool:
    """Whether UserRL's reply parser of `gym` reads a JSON object from `text`."""
    import ast

    text = text.strip()
    try:
        if gym == "persuade":  # literal_eval of the reply less a ```json fence
            body = text[7:] if text.startswith("```json") else text
            return isinstance(ast.literal_eval(body[:-3] if body.endswith("```") else body), dict)
        if gym == "intention":  # json.loads of the greedy {...} match
            match = re.search(r"\{.*\}", text, re.DOTALL)
            return match is not None and isinstance(json.loads(match.group()), dict)
        if gym == "travel":
            return sys.modules["travelgym.env.utils"].parse_output_as_json(text) is not None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def doc_lenient_json(d: Diff, u: Outcome, o: Outcome) -> bool:
    from gyms.reply_json import extract_json_object

    return any(r != FAIL and extract_json_object(r) is not None and not _userrl_parses(d.gym, r) for r in d.replies)


def doc_intention_duplicate(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "intention" and d.kind == "reward" and "duplicate_index" in d.notes


def doc_persuade_baseline(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "persuade" and d.kind == "reward" and "baseline" in d.notes


def doc_persuade_unknown_stance(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "persuade" and "unknown_stance" in d.notes and o.sim_error


TRAVEL_SEARCH_CORRECT = "You have provided the correct search request arguments.\n\n"
TRAVEL_CANNOT_REPLY = "I'm sorry, I'm not sure how to respond to your latest utterance right now. Please try again."


def doc_travel_schema(d: Diff, u: Outcome, o: Outcome) -> bool:
    def options(text: str) -> str:
        return text.split("\n\nHere are all the options for <", 1)[-1]

    return (
        d.gym == "travel"
        and d.kind == "observation"
        and u.feedback.startswith(TRAVEL_SEARCH_CORRECT)
        and o.feedback.startswith(TRAVEL_SEARCH_CORRECT)
        and options(u.feedback) == options(o.feedback)
    )


def doc_travel_multiple_ids(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "travel" and o.feedback.startswith("You have chosen multiple options.") and "," in d.action


def doc_travel_aspect_not_in_trip(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "travel" and re.fullmatch(r"This trip has no [a-z ]+ to book\.", o.feedback) is not None


def doc_travel_end_after_choices(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "travel" and d.kind == "ending" and o.done and not u.ended and "choice" in o.info


def doc_travel_proactive(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "travel" and "volunteered" in o.info and u.feedback == TRAVEL_CANNOT_REPLY


def doc_prose_answer(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "function" and "prose_answer" in d.notes


def doc_search_no_results(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.gym == "search" and "no_results" in d.notes and o.feedback.startswith("No results found for")


def doc_turtle_rounding(d: Diff, u: Outcome, o: Outcome) -> bool:
    return (
        d.gym == "turtle"
        and "score_rounding" in d.notes
        and (d.kind in ("ending", "flags") or (d.kind == "reward" and abs(u.reward - o.reward) < 1e-6))
    )


def doc_after_end(d: Diff, u: Outcome, o: Outcome) -> bool:
    return d.kind == "error" and "Episode is complete" in str(d.userrl)


DOCUMENTED: dict[str, Callable[[Diff, Outcome, Outcome], bool]] = {
    "all | done vs truncated": doc_flags,
    "all | tag parsing": doc_tag_parsing,
    "Telepathy, Turtle | an untagged action": doc_untagged_first8,
    "Intention, Persuade, Telepathy, Turtle, Travel | an empty action": doc_empty_action,
    "all | the simulator fails for good": doc_sim_failure,
    "Function | an answer written in prose": doc_prose_answer,
    "Search | a search that finds nothing": doc_search_no_results,
    "all | a step after the end": doc_after_end,
    "Turtle | the story score (rounded to 6 places)": doc_turtle_rounding,
    "all | simulator retries and JSON (a reply only this project's parser reads)": doc_lenient_json,
    "Intention | a detail named twice in one judge reply": doc_intention_duplicate,
    "Persuade | reward baseline": doc_persuade_baseline,
    "Persuade | an unknown stance string": doc_persuade_unknown_stance,
    "Travel | the option schema before search results": doc_travel_schema,
    "Travel | [answer] H1, F3": doc_travel_multiple_ids,
    "Travel | an id of an aspect not in the trip": doc_travel_aspect_not_in_trip,
    "Travel | the end after one choice per aspect": doc_travel_end_after_choices,
    "Travel | proactive elicitation": doc_travel_proactive,
}


def classify(d: Diff, u: Outcome, o: Outcome) -> str:
    for row, predicate in DOCUMENTED.items():
        if predicate(d, u, o):
            return row
    return ""
