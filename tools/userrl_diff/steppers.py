"""Random action sequences and scripted replies per gym (the same on both sides), and both sides built for one
task."""

import copy
import dataclasses
import json
import os
import random
import sys
import types
from collections.abc import Callable
from typing import Any

from .harness import FAIL, SCRIPT, ScriptedSim

# --------------------------------------------------------------------------------------------------------------
# Action and reply generators, per gym. Each returns (action, replies for this step, notes for the classifier).

WHITESPACE_TAG_VARIANTS = ("upper", "space", "plain")


def tagged(rng: random.Random, tag: str, payload: str) -> tuple[str, set[str]]:
    """`[tag] payload`, sometimes with the tag upper-cased or after leading whitespace (noted for the classifier)."""
    roll = rng.random()
    if roll < 0.03:
        return f"[{tag.upper()}] {payload}", {"tag_case"}
    if roll < 0.06:
        return f"  [{tag}] {payload}", {"tag_space"}
    if roll < 0.09:
        return f"[{tag}]{payload}", set()
    return f"[{tag}] {payload}".rstrip() if not payload else f"[{tag}] {payload}", set()


def pick(rng: random.Random, payloads: list[str], empty: float = 0.06) -> str:
    """One of `payloads`, or (with probability `empty`) the empty payload."""
    return "" if rng.random() < empty else rng.choice(payloads)


NOISE_ACTIONS = ["hello there", "", "[foo] bar", "[Action] what?", "answer: 42", "[finish", "[search]", "[action]"]


def untagged(rng: random.Random) -> tuple[str, set[str]]:
    return rng.choice(NOISE_ACTIONS), {"untagged"}


@dataclasses.dataclass
class Case:
    gym: str
    task: Any  # our Task
    userrl_env: Any
    ours: Any
    max_steps: int
    state: dict[str, Any] = dataclasses.field(default_factory=dict)


def _bad_json_reply(rng: random.Random) -> str:
    return rng.choice([FAIL, "not json at all", "{'thought': 'unterminated", FAIL])


# ---- FunctionGym


def function_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    rec = case.task.metadata["record"]
    test = json.loads(rec["test_case"]) if isinstance(rec["test_case"], str) else list(rec["test_case"])
    expected = float(rec["expected_result"])
    nums = [rng.choice([0, 1, 2, 3, 5, 7, 10, -2, 0.5, 99, 1000]) for _ in range(4)]
    choices: list[Callable[[], tuple[str, set[str]]]] = [
        lambda: tagged(rng, "action", " ".join(str(n) for n in nums)),
        lambda: tagged(rng, "action", ", ".join(str(n) for n in nums)),
        lambda: tagged(rng, "action", " ".join(str(n) for n in test)),
        lambda: tagged(rng, "action", "1 2 3"),
        lambda: tagged(rng, "action", ""),
        lambda: tagged(rng, "action", "a=1, b=2.5, c=-3, d=4.0"),
        lambda: tagged(rng, "action", "999999 999999 999999 999999"),
        lambda: tagged(rng, "search", rng.choice(["test", "TEST", "test case", ""])),
        lambda: tagged(rng, "answer", rng.choice([str(expected), str(int(expected)), f"{expected + 1}"])),
        lambda: tagged(rng, "answer", rng.choice(["", "abc", "1e3", "inf", "nan", " 7 ", "-0", "1/2"])),
        lambda: (f"[answer] The result is {int(expected)}.", {"prose_answer"}),
        lambda: tagged(rng, "finish", rng.choice(["", "done"])),
        lambda: untagged(rng),
    ]
    action, notes = rng.choice(choices)()
    return action, [], notes


# ---- TurtleGym / TelepathyGym


def _question_reply(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return _bad_json_reply(rng)
    word = rng.choice(["Yes", "No", "Irrelevant", "Yes, partly.", "No."])
    body = json.dumps({"thought": "scripted", "response": word})
    return f"```json\n{body}\n```" if rng.random() < 0.2 else body


def turtle_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    rec = case.task.metadata["record"]
    rubric = rec["evaluation"] if isinstance(rec["evaluation"], list) else []
    roll = rng.random()
    if roll < 0.35:
        action, notes = tagged(rng, "action", pick(rng, ["Was it murder?", "Did she die?", "Was it night?"]))
        return action, [_question_reply(rng)], notes
    if roll < 0.75:
        action, notes = tagged(rng, "answer", pick(rng, ["She was hanged by the husband.", "A story."]))
        grades = [rng.choice([0, 0.5, 1, 1, 1]) for _ in rubric]
        extra = rng.random()
        if extra < 0.05:
            grades = grades[:-1]
            notes.add("bad_grades")
        elif extra < 0.1 and grades:
            grades[0] = 0.7
            notes.add("bad_grades")
        elif extra < 0.15:
            return action, [_bad_json_reply(rng)], notes
        if len(grades) == len(rubric):
            raw = 0.0
            for criterion, grade in zip(rubric, grades, strict=True):
                raw += criterion["score"] * grade  # UserRL's float sum
            if raw < 1.0 <= round(raw, 6) or (raw != round(raw, 6) and "bad_grades" not in notes):
                notes.add("score_rounding")
        rows = [{"statement": f"s{i}", "thought": "", "score": g} for i, g in enumerate(grades)]
        return action, [json.dumps({"scores": rows, "feedback": "scripted"})], notes
    if roll < 0.85:
        action, notes = tagged(rng, "finish", rng.choice(["", "bye"]))
        return action, [], notes
    if roll < 0.9:
        action, notes = tagged(rng, "search", "the answer")
        return action, [_question_reply(rng)], notes
    action, notes = untagged(rng)
    return action, [_question_reply(rng)], notes


def telepathy_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    rec = case.task.metadata["record"]
    roll = rng.random()
    if roll < 0.45:
        action, notes = tagged(rng, "action", pick(rng, ["Is it alive?", "Is it bigger than a car?", "Is it red?"]))
        return action, [_question_reply(rng)], notes
    if roll < 0.8:
        action, notes = tagged(rng, "answer", pick(rng, [rec["title"], "A banana"]))
        verdict = rng.choice(["Yes", "No", "No", "yes"])
        if rng.random() < 0.1:
            return action, [_bad_json_reply(rng)], notes
        if rng.random() < 0.05:
            return action, [json.dumps({"thought": "", "judgment": verdict})], notes | {"missing_field"}
        return action, [json.dumps({"thought": "t", "judgment": verdict, "feedback": f"scripted {verdict}"})], notes
    if roll < 0.88:
        action, notes = tagged(rng, "finish", rng.choice(["", "bye"]))
        return action, [], notes
    if roll < 0.92:
        action, notes = tagged(rng, "search", "hint")
        return action, [_question_reply(rng)], notes
    action, notes = untagged(rng)
    return action, [_question_reply(rng)], notes


# ---- SearchGym: scripted Serper payloads


def serper_payload(rng: random.Random) -> dict[str, Any]:
    organic = []
    for i in range(rng.choice([0, 1, 3, 8])):
        item: dict[str, Any] = {"title": f"Result {i} ", "link": f"https://example.org/{i}"}
        if rng.random() < 0.85:
            item["snippet"] = rng.choice([f"Snippet {i} text.", f"  padded {i}  ", f"Line {i}\nnext"])
        organic.append(item)
    payload: dict[str, Any] = {"organic": organic}
    box = rng.random()
    if box < 0.2:
        payload["answerBox"] = {"title": "Box", "answer": "42"}
    elif box < 0.35:
        payload["answerBox"] = {"title": "Box", "snippet": "Box snippet"}
    elif box < 0.45:
        payload["answerBox"] = {"answer": "untitled"}
    return payload


def search_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    rec = case.task.metadata["record"]
    gold = rec["answer"]
    roll = rng.random()
    if roll < 0.4:
        action, notes = tagged(rng, "search", rng.choice(["who was it", rec["question"][:40], ""]))
        payload = serper_payload(rng)
        shown = any("title" in o and "snippet" in o for o in payload["organic"])
        box = payload.get("answerBox", {})
        if not payload["organic"] or not (shown or ("title" in box and ("answer" in box or "snippet" in box))):
            notes.add("no_results")
        return action, [json.dumps(payload)], notes
    if roll < 0.8:
        answer = rng.choice([gold, gold.upper(), f" {gold}.", "wrong answer", "", "!!!"])
        action, notes = tagged(rng, "answer", answer)
        verdict = rng.choice(["Yes", "No", "yes"])
        if rng.random() < 0.1:
            return action, [_bad_json_reply(rng)], notes
        return action, [json.dumps({"reasoning": "r", "judgment": verdict, "feedback": "f"})], notes
    if roll < 0.88:
        action, notes = tagged(rng, "finish", "")
        return action, [], notes
    action, notes = untagged(rng)
    return action, [], notes


class ScriptedSerperConnection:
    """UserRL's `http.client` connection to Serper, answering with the step's scripted payload."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        pass

    def getresponse(self) -> Any:
        text = SCRIPT.queues["userrl"][0] if SCRIPT.queues["userrl"] else "{}"
        return types.SimpleNamespace(read=lambda: text.encode("utf-8"))


def install_search_fakes() -> None:
    import searchgym.utils as utils

    from gyms.search.web import WebSearch, parse_results

    utils.conn = ScriptedSerperConnection()

    async def search(self: Any, query: str, k: int) -> Any:
        text = SCRIPT.queues["ours"][0] if SCRIPT.queues["ours"] else "{}"
        return parse_results(json.loads(text))[:k]

    WebSearch.search = search  # type: ignore[method-assign]
    os.environ.setdefault("SERPER_API_KEY", "scripted")


# ---- IntentionGym, PersuadeGym, TravelGym: the simulated user's replies


def _user_reply(rng: random.Random, notes: set[str], **extra: Any) -> str:
    """A simulated user's JSON reply `{thought, response, **extra}`: its response plain, padded or missing; the
    object plain, fenced, Python-literal (which UserRL's `json.loads` refuses) or wrapped in prose; or no JSON, or a
    failed call."""
    if rng.random() < 0.05:
        return _bad_json_reply(rng)
    body: dict[str, Any] = {"thought": "scripted", "response": rng.choice(["Sure, about a week.", "Hm, maybe."])}
    body.update(extra)
    content = rng.random()
    if content < 0.05:
        body["response"] = "  padded reply \n"
    elif content < 0.07:
        del body["response"]
        notes.add("missing_field")
    form = rng.random()
    if form < 0.03:
        return repr(body)  # Python literal: single quotes
    if form < 0.06:
        return f"Here is my reply: {json.dumps(body)} Thanks."
    if form < 0.12:
        return "```json\n" + json.dumps(body, indent=2) + "\n```"
    return json.dumps(body)


def utterance(rng: random.Random, finishes: list[str], tags: list[str], utterances: list[str], up_to_tagged: float,
              searches: list[str], up_to_search: float) -> tuple[str, set[str], bool]:  # fmt: skip
    """One action of a conversational gym: `[finish]` (6%), else an utterance under one of `tags` (roll below
    `up_to_tagged`), a search (below `up_to_search`) or an untagged one; the flag is True for `[finish]`, after
    which no simulator call follows."""
    roll = rng.random()
    if roll < 0.06:
        action, notes = tagged(rng, "finish", rng.choice(finishes))
        return action, notes, True
    if roll < up_to_tagged:
        action, notes = tagged(rng, rng.choice(tags), pick(rng, utterances))
    elif roll < up_to_search:
        action, notes = tagged(rng, "search", pick(rng, searches))
    else:
        action, notes = untagged(rng)
    return action, notes, False


def intention_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    remaining = len(case.ours.remaining)
    questions = ["What is your budget?", "When?", "Which city do you prefer?"]
    action, notes, finished = utterance(rng, ["", "thanks"], ["action", "action", "answer"], questions, 0.8,
                                        ["budget", "dates"], 0.86)  # fmt: skip
    if finished:
        return action, [], notes
    answer = _user_reply(rng, notes)
    # The judge: UserRL reads `covered_detail_indices` (from 0), this project `covered_detail_numbers` (from 1).
    indices: list[Any] = rng.sample(range(remaining), k=min(remaining, rng.choice([0, 1, 1, 1, 2, 3])))
    extra = rng.random()
    if extra < 0.05 and indices:
        indices.append(indices[0])
        notes.add("duplicate_index")
    elif extra < 0.1:
        indices.append(rng.choice([remaining, remaining + 3]))  # out of range: ignored by both
    numbers: list[Any] = [i + 1 for i in indices]
    if rng.random() < 0.05 and indices:
        indices, numbers = [str(i) for i in indices], [str(n) for n in numbers]
    related = rng.choice([True, True, True, False, "false", 0, None])
    verdict = {"analysis": "scripted", "is_task_related": related, "covered_detail_indices": indices,
               "covered_detail_numbers": numbers}  # fmt: skip
    if related is None:
        del verdict["is_task_related"]
    roll = rng.random()
    if roll < 0.04:
        judge = _bad_json_reply(rng)
    elif roll < 0.06:
        del verdict["covered_detail_numbers"], verdict["covered_detail_indices"]
        judge = json.dumps(verdict)
        notes.add("missing_field")
    elif roll < 0.08:
        judge = repr(verdict)
    elif roll < 0.15:
        judge = "```json\n" + json.dumps(verdict) + "\n```"
    else:
        judge = json.dumps(verdict)
    return action, [answer, judge], notes


STANCES = ("Strongly Agree", "Agree", "Partly Agree", "Neutral", "Partly Disagree", "Disagree", "Strongly Disagree")


def persuade_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    arguments = ["Dogs are loyal.", "Studies show otherwise.", "Think again."]
    action, notes, finished = utterance(rng, ["", "bye"], ["action", "answer", "answer"], arguments, 0.82,
                                        ["evidence"], 0.87)  # fmt: skip
    if finished:
        return action, [], notes
    stance_roll = rng.random()
    now = case.ours.stance
    if stance_roll < 0.06:
        stance = rng.choice(["strongly disagree", "Somewhat Agree", " Neutral"])
        notes.add("unknown_stance")
    else:
        stance = STANCES[max(0, min(6, now + rng.choice([-2, -1, 0, 1, 1, 2, 3, 6])))]
        new = STANCES.index(stance)
        if max(0, new - now) != max(0, new - case.ours.best_stance):
            notes.add("baseline")  # UserRL pays the gain over the previous stance, this project over the best
    reply = _user_reply(rng, notes, stance=stance)
    if rng.random() < 0.03:
        reply = json.dumps({"thought": "", "response": "Fine.", "stance": stance, "final": True})  # JSON `true`
    return action, [reply], notes


def travel_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    scenario = case.ours.scenario
    dims = scenario["dimensions"]
    roll = rng.random()
    if roll < 0.25:
        action, notes = tagged(rng, "search", pick(rng, ["hotel in Paris for 3 nights", "flights please"]))
        verdict: dict[str, Any] = {"alignment_judgement": rng.choice(["True", "True", "False", "N/A", "Maybe"])}
        aspect_roll = rng.random()
        if aspect_roll < 0.7:
            verdict["alignment_aspect"] = rng.choice(dims)
        elif aspect_roll < 0.8:
            verdict["alignment_aspect"] = rng.choice(["Rental Car", "car rental", " Hotel ", "FLIGHT"])
        elif aspect_roll < 0.9:
            verdict["alignment_aspect"] = rng.choice([a for a in ("flight", "hotel", "apartment", "restaurant",
                                                                  "rental_car") if a not in dims])  # fmt: skip
        roll = rng.random()
        if roll < 0.08:
            return action, [_bad_json_reply(rng)], notes
        if roll < 0.12:
            return action, [repr(verdict)], notes
        if roll < 0.2:
            return action, ["```json\n" + json.dumps(verdict) + "\n```"], notes
        return action, [json.dumps(verdict)], notes
    if roll < 0.6:
        action, notes = tagged(rng, "action", pick(rng, ["Which airline do you like?", "How about the hotel?", "Hi!"]))
        remaining = [p["id"] for p in case.ours.remaining]
        kind = rng.choice(["1", "2", "2", "2", "3", "4", 2, "5"])
        judged: dict[str, Any] = {"type": kind}
        if str(kind) == "2":
            judged["preference_id"] = rng.choice(remaining) if remaining and rng.random() < 0.85 else "P99"
        roll = rng.random()
        if roll < 0.06:
            judge = _bad_json_reply(rng)
        elif roll < 0.09:
            judge = json.dumps({"preference_id": "P1"})
            notes.add("missing_field")
        elif roll < 0.12:
            judge = repr(judged)
        else:
            judge = json.dumps(judged)
        return action, [judge, _user_reply(rng, notes)], notes
    if roll < 0.88:
        ids: list[str] = []
        for aspect in dims:
            spec = scenario["aspects"][aspect]
            ids += [spec["best_id"], spec["correct_ids"][0], spec["options"][-1]["id"]]
        absent = [a for a in ("flight", "hotel", "apartment", "restaurant", "rental_car") if a not in dims]
        initials = {"flight": "F", "hotel": "H", "apartment": "A", "restaurant": "R", "rental_car": "C"}
        odd = ["", "h1", "X9", "Hotel", f"{ids[0]}, {ids[-1]}", f"{ids[0]},", f"{ids[0]} ", "F1 and H2"]
        odd += [f"{initials[a]}{rng.randint(1, 17)}" for a in absent]
        payload = rng.choice(ids) if rng.random() < 0.7 else rng.choice(odd)
        action, notes = tagged(rng, "answer", payload)
        return action, [], notes
    if roll < 0.93:
        action, notes = tagged(rng, "finish", rng.choice(["", "done"]))
        return action, [], notes
    action, notes = untagged(rng)
    return action, [_user_reply(rng, notes), _user_reply(rng, notes)], notes


def userrl_task_of_travel(scenario: dict[str, Any]) -> dict[str, Any]:
    """A generated scenario in the task layout UserRL's `travelgym.env.task_data.load_tasks` builds from its data
    files (which are not public), the options in the order this project shows them."""
    data: dict[str, Any] = {"scenario": scenario["scenario"], "dimensions": list(scenario["dimensions"])}
    for aspect in scenario["dimensions"]:
        spec = scenario["aspects"][aspect]
        prefs = [[p["aspect"], p["subcategory"], p["preference"], p["implicit_elicitation"]]
                 for p in scenario["preferences"] if p["aspect"] == aspect]  # fmt: skip
        data[aspect] = {"preferences": prefs, "correct_ids": list(spec["correct_ids"]), "best_id": spec["best_id"],
                        "arguments": spec["arguments"]}  # fmt: skip
    return {
        "id": scenario["id"],
        "scenario": scenario["scenario"],
        "category": "travel_planning",
        "dimensions": list(scenario["dimensions"]),
        "initial_desc": scenario["initial_description"],
        "preferences": data,
        "all_options": {a: [dict(o) for o in scenario["aspects"][a]["options"]] for a in scenario["dimensions"]},
        "arguments": {a: scenario["aspects"][a]["arguments"] for a in scenario["dimensions"]},
    }


# --------------------------------------------------------------------------------------------------------------
# Building both sides for one task


def build_case(gym: str, task: Any, max_steps: int, userrl: Any) -> Case:
    import gyms
    from userrl_megatron.config.schema import GymsConfig

    cfg = gyms.config_for(gym, GymsConfig(), max_steps)
    rec = task.metadata["record"]
    ucfg = userrl.get_default_config()
    ucfg.max_steps = max_steps
    ucfg.data_mode = "single"
    ucfg.api_key, ucfg.base_url = "scripted", "http://scripted"
    if gym == "function":
        ucfg.data_source = rec["id"]
        env = userrl.FunctionEnv(config=ucfg)
    elif gym == "turtle":
        ucfg.data_source, ucfg.success_threshold = rec["new_title"], 1.0
        env = userrl.StoryEnv(config=ucfg)
    elif gym == "telepathy":
        ucfg.data_source = rec["title"]
        env = userrl.TelepathyEnv(config=ucfg)
    elif gym == "search":
        ucfg.data_source, ucfg.eval_method = rec["id"], "llm"
        env = userrl.SearchEnv(config=ucfg)
        cfg = dataclasses.replace(cfg, backend="web", judge="llm")
    elif gym == "intention":
        ucfg.data_source = rec["id"]
        env = userrl.IntentionEnv(config=ucfg)
    elif gym == "persuade":  # UserRL's statements file is not public: its lookup is fed this project's record
        ucfg.data_source = rec["id"]
        persuade_env: Any = sys.modules["persuadegym.env.persuade_env"]
        persuade_env.load_statements = lambda: [dict(rec)]
        persuade_env.get_statement_by_id = lambda statement_id: dict(rec)
        env = userrl.PersuadeEnv(config=ucfg)
    elif gym == "travel":  # UserRL's scenario files are not public: its lookup is fed this project's scenario
        ours = gyms.make_gym(gym, task, cfg, ScriptedSim())
        ucfg.data_source, ucfg.one_choice_per_aspect = rec["id"], True  # env_manager's training settings
        ucfg.search_correct_reward, ucfg.preference_correct_reward = 0.0, 0.8
        travel_task = userrl_task_of_travel(ours.scenario)  # type: ignore[attr-defined]
        travel_env: Any = sys.modules["travelgym.env.travel_env"]
        travel_env.get_task_by_id = lambda task_id: copy.deepcopy(travel_task)
        env = userrl.TravelEnv(config=ucfg)
        return Case(gym, task, env, ours, max_steps)
    else:
        raise ValueError(gym)
    ours = gyms.make_gym(gym, task, cfg, ScriptedSim())
    return Case(gym, task, env, ours, max_steps)


SPLITS = {"search": ("test",)}  # Bamboogle has a test split only
STEPPERS: dict[str, Callable[[random.Random, Case], tuple[str, list[str], set[str]]]] = {
    "function": function_step,
    "turtle": turtle_step,
    "telepathy": telepathy_step,
    "search": search_step,
    "intention": intention_step,
    "persuade": persuade_step,
    "travel": travel_step,
}
# UserRL's attempts per LLM call where it retries a failed call (a scripted failure fails them all)
USERRL_ATTEMPTS = {"persuade": 3, "travel": 3}
