"""Differential run of this project's gyms against UserRL's own gym code (SalesforceAIResearch/UserRL).

    python tools/diff_userrl.py --userrl /tmp/userrl [--data-dir ../shared/data] [--cases 40] [--seed 0]
                                [--gyms function,turtle,...] [--out diff_userrl.jsonl]

UserRL's environment classes are imported from the checkout (`<userrl>/gyms/<Name>Gym`, configured as UserRL's
`verl/tools/env_manager.py` configures them for training) and driven through `step_async`, the path its
InteractTool uses. Their LLM clients (`OpenAI` / `AsyncOpenAI` in each gym's prompt module) are replaced by a
scripted client, and the Serper connection of SearchGym by a scripted one; this project's gyms get the same
scripted replies through a stand-in for `gyms.user_sim.UserSimulator` (the `chat` coroutine) and a stand-in for the
web search request. PersuadeGym's statements and TravelGym's scenario files are not public: UserRL's lookups of
them are fed this project's record and generated scenario (in the task layout UserRL's loader builds). IntentionGym's
scripted judge replies carry both sides' fields (UserRL's `covered_detail_indices` from 0, this project's
`covered_detail_numbers` from 1). Every case plays one task with one random action sequence (valid and wrong
answers, empty and invalid tags, case and whitespace variants of tags, `[finish]`, repeats, the step limit) and per
step scripted simulator replies (valid, fenced, padded, Python-literal, wrapped in prose, malformed, failing; a
failure fails every retry UserRL makes), the same on both sides. Per step it compares the observation text, the
reward (to 1e-9) and the ending (done or truncated; the split between the two flags separately), and stops a case
at the first step after which the two sides' states may differ (a difference, or in TravelGym a failed simulator
call).

Each difference is classified as documented (a row of gyms/README.md's difference table, by the predicates in
`DOCUMENTED`) or undocumented, written as one JSON line to `--out`, and counted in the printed table. Exit status 1
when any difference is undocumented. gymnasium is stubbed when it is not installed (UserRL's envs only build
their spaces with it).
"""

import argparse
import asyncio
import collections
import contextlib
import copy
import dataclasses
import hashlib
import importlib
import io
import json
import os
import random
import re
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAIL = "<<simulator failure>>"  # a scripted reply meaning: the call fails (every retry)
TAGS = ("[action]", "[answer]", "[search]", "[finish]")

# --------------------------------------------------------------------------------------------------------------
# Scripted LLM replies, shared by both sides: each step sets one queue of reply texts per side.


class Script:
    def __init__(self) -> None:
        self.queues: dict[str, collections.deque[str]] = {"userrl": collections.deque(), "ours": collections.deque()}
        self.calls: dict[str, int] = {"userrl": 0, "ours": 0}
        self.unscripted: dict[str, int] = {"userrl": 0, "ours": 0}

    def set(self, replies: list[str], userrl_attempts: int = 1) -> None:
        """Queue `replies` on both sides; UserRL's side gets each failure `userrl_attempts` times (its retries)."""
        for side in self.queues:
            attempts = userrl_attempts if side == "userrl" else 1
            self.queues[side] = collections.deque(r for r in replies for _ in range(attempts if r == FAIL else 1))
            self.calls[side] = 0
            self.unscripted[side] = 0

    def next(self, side: str, messages: list[dict[str, Any]]) -> str:
        self.calls[side] += 1
        if not self.queues[side]:
            self.unscripted[side] += 1
            return FAIL
        return self.queues[side].popleft()


SCRIPT = Script()


class _Completions:
    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous

    def _reply(self, messages: list[dict[str, Any]]) -> Any:
        text = SCRIPT.next("userrl", messages)
        if text == FAIL:
            raise RuntimeError("scripted simulator failure")
        message = types.SimpleNamespace(content=text, role="assistant")
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=message)])

    def create(self, **kwargs: Any) -> Any:
        if self.asynchronous:

            async def reply() -> Any:
                return self._reply(kwargs["messages"])

            return reply()
        return self._reply(kwargs["messages"])


class FakeOpenAI:
    asynchronous = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.chat = types.SimpleNamespace(completions=_Completions(self.asynchronous))


class FakeAsyncOpenAI(FakeOpenAI):
    asynchronous = True


class ScriptedSim:
    """Our side: `chat` as gyms.user_sim.UserSimulator's, answering from the script (a failure: UserSimError)."""

    async def chat(self, messages: list[dict[str, Any]], *, temperature: Any = None, max_tokens: Any = None,
                   json: bool = False) -> Any:  # fmt: skip
        from gyms.reply_json import extract_json_object, strip_think
        from gyms.user_sim import Reply, UserSimError

        text = SCRIPT.next("ours", messages)
        if text == FAIL:
            raise UserSimError("scripted simulator failure", "http", 3)
        text = strip_think(text)
        data = extract_json_object(text) if json else None
        if json and data is None:
            raise UserSimError(f"no JSON object in reply: {text[:200]!r}", "bad_json", 3)
        return Reply(text=text, data=data)

    async def close(self) -> None:
        pass


async def _no_sleep(*args: Any, **kwargs: Any) -> None:
    return None


class _AsyncioProxy(types.ModuleType):
    """The asyncio module with `sleep` returning at once (UserRL sleeps 2 s between failed LLM attempts)."""

    def __getattr__(self, name: str) -> Any:
        return _no_sleep if name == "sleep" else getattr(asyncio, name)


class _TimeProxy(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        import time

        return (lambda *a: None) if name == "sleep" else getattr(time, name)


def _patch_llm(module: Any) -> None:
    for name, fake in (("OpenAI", FakeOpenAI), ("AsyncOpenAI", FakeAsyncOpenAI)):
        if hasattr(module, name):
            setattr(module, name, fake)
    if hasattr(module, "openai"):  # IntentionGym calls `openai.AsyncOpenAI(...)` through the module
        module.openai = types.SimpleNamespace(OpenAI=FakeOpenAI, AsyncOpenAI=FakeAsyncOpenAI)
    if hasattr(module, "asyncio"):
        module.asyncio = _AsyncioProxy("asyncio")
    if hasattr(module, "time"):
        module.time = _TimeProxy("time")


# --------------------------------------------------------------------------------------------------------------
# Importing UserRL


def _stub_gymnasium() -> None:
    try:
        importlib.import_module("gymnasium")
        return
    except ImportError:
        pass

    class Space:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Env:
        def reset(self, *, seed: Any = None, options: Any = None) -> Any:
            return None

    gym = types.ModuleType("gymnasium")
    spaces = types.ModuleType("gymnasium.spaces")
    for name in ("Discrete", "Dict", "Text", "Box", "MultiDiscrete", "Sequence", "Tuple", "MultiBinary"):
        setattr(spaces, name, type(name, (Space,), {}))
    gym.Env = Env  # type: ignore[attr-defined]
    gym.spaces = spaces  # type: ignore[attr-defined]
    gym.register = lambda *a, **k: None  # type: ignore[attr-defined]
    sys.modules["gymnasium"] = gym
    sys.modules["gymnasium.spaces"] = spaces


USERRL_PACKAGES = {
    "function": ("FunctionGym", "functiongym", ["functiongym.env.function_env"]),
    "turtle": ("TurtleGym", "turtlegym", ["turtlegym.env.prompts"]),
    "telepathy": ("TelepathyGym", "telepathygym", ["telepathygym.env.prompts"]),
    "search": ("SearchGym", "searchgym", ["searchgym.env.prompts", "searchgym.utils"]),
    "travel": ("TravelGym", "travelgym", ["travelgym.env.prompts", "travelgym.env.prompt_async"]),
    "intention": ("IntentionGym", "intentiongym", ["intentiongym.env.prompts"]),
    "persuade": ("PersuadeGym", "persuadegym", ["persuadegym.env.prompts"]),
}


def import_userrl(userrl: Path, gym: str, data_dir: Path) -> Any:
    """UserRL's package of `gym`, its LLM clients scripted; its data files checked against the data folder."""
    folder, package, llm_modules = USERRL_PACKAGES[gym]
    root = userrl / "gyms" / folder
    if not root.is_dir():
        raise SystemExit(f"{root} not found: --userrl must be a UserRL checkout")
    ours = data_dir / "userrl" / "gyms" / folder / package / "data"
    theirs = root / package / "data"
    for path in sorted(ours.glob("*")) if ours.is_dir() else []:
        target = theirs / path.name
        if not target.exists():
            theirs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        elif _sha(target) != _sha(path):
            raise SystemExit(f"{target} differs from {path}: the checkout is not UserRL cf55a30's data")
    if gym == "search":
        os.environ.setdefault("SERPER_API_KEY", "scripted")
    sys.path.insert(0, str(root))
    module = importlib.import_module(package)
    for name in llm_modules:
        _patch_llm(importlib.import_module(name))
    return module


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# One step on each side


@dataclasses.dataclass
class Outcome:
    feedback: str
    reward: float
    done: bool
    truncated: bool
    error: str = ""  # an exception the side raised
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # our StepResult.info (empty for UserRL)
    sim_error: bool = False  # our side: the step's simulator call failed for good (StepResult.user_sim_error)

    @property
    def ended(self) -> bool:
        return self.done or self.truncated


async def userrl_step(env: Any, action: str) -> Outcome:
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # UserRL prints its LLM errors
            obs, reward, terminated, truncated, _ = await env.step_async(action)
    except Exception as e:  # recorded as a difference
        return Outcome("", 0.0, False, False, f"{type(e).__name__}: {e}")
    feedback = obs.get("feedback", "") if isinstance(obs, dict) else str(obs)
    return Outcome(str(feedback), float(reward), bool(terminated), bool(truncated))


async def our_step(gym: Any, action: str) -> Outcome:
    try:
        r = await gym.step(action)
    except Exception as e:
        return Outcome("", 0.0, False, False, f"{type(e).__name__}: {e}")
    return Outcome(r.feedback, float(r.reward), r.done, r.truncated, info=r.info, sim_error=bool(r.user_sim_error))


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


def intention_step(rng: random.Random, case: Case) -> tuple[str, list[str], set[str]]:
    remaining = len(case.ours.remaining)
    roll = rng.random()
    if roll < 0.06:
        action, notes = tagged(rng, "finish", rng.choice(["", "thanks"]))
        return action, [], notes
    if roll < 0.8:
        tag = rng.choice(["action", "action", "answer"])
        action, notes = tagged(rng, tag, pick(rng, ["What is your budget?", "When?", "Which city do you prefer?"]))
    elif roll < 0.86:
        action, notes = tagged(rng, "search", pick(rng, ["budget", "dates"]))
    else:
        action, notes = untagged(rng)
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
    roll = rng.random()
    if roll < 0.06:
        action, notes = tagged(rng, "finish", rng.choice(["", "bye"]))
        return action, [], notes
    if roll < 0.82:
        tag = rng.choice(["action", "answer", "answer"])
        action, notes = tagged(rng, tag, pick(rng, ["Dogs are loyal.", "Studies show otherwise.", "Think again."]))
    elif roll < 0.87:
        action, notes = tagged(rng, "search", pick(rng, ["evidence"]))
    else:
        action, notes = untagged(rng)
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


# --------------------------------------------------------------------------------------------------------------
# Running


def compare(u: Outcome, o: Outcome) -> list[tuple[str, Any, Any]]:
    found: list[tuple[str, Any, Any]] = []
    if u.error or o.error:
        found.append(("error", u.error, o.error))
        return found
    if u.feedback != o.feedback:
        found.append(("observation", u.feedback, o.feedback))
    if abs(u.reward - o.reward) > 1e-9:
        found.append(("reward", u.reward, o.reward))
    if u.ended != o.ended:
        found.append(("ending", [u.done, u.truncated], [o.done, o.truncated]))
    elif (u.done, u.truncated) != (o.done, o.truncated):
        found.append(("flags", [u.done, u.truncated], [o.done, o.truncated]))
    return found


async def run_case(gym: str, index: int, task: Any, userrl: Any, rng: random.Random, stats: dict[str, Any],
                   diffs: list[Diff]) -> None:  # fmt: skip
    max_steps = rng.choice([3, 5, 8, 12, 20])
    case = build_case(gym, task, max_steps, userrl)
    obs, _ = case.userrl_env.reset()
    first = await case.ours.reset()
    stats["cases"] += 1
    if obs.get("feedback") != first:
        d = Diff(gym, index, task.task_id, 0, "observation", "<reset>", obs.get("feedback"), first, [], [])
        diffs.append(d)
    for step in range(1, max_steps + 2):
        action, replies, notes = STEPPERS[gym](rng, case)
        SCRIPT.set(replies, USERRL_ATTEMPTS.get(gym, 1))
        u = await userrl_step(case.userrl_env, action)
        SCRIPT.set(replies)
        o = await our_step(case.ours, action)
        stats["steps"] += 1
        if SCRIPT.unscripted["userrl"] or SCRIPT.unscripted["ours"]:
            notes.add("unscripted_call")
        found = compare(u, o)
        for kind, uv, ov in found:
            d = Diff(gym, index, task.task_id, step, kind, action, uv, ov, sorted(notes), replies)
            d.documented = classify(d, u, o)
            diffs.append(d)
        # After a difference the two states may differ, and in TravelGym after a failed simulator call too (this
        # project leaves its state as it was, UserRL counts the utterance toward its proactive elicitation): the
        # case stops.
        if found or u.ended or o.ended or (o.sim_error and gym == "travel"):
            break


def summary(stats: dict[str, dict[str, Any]], diffs: list[Diff]) -> str:
    kinds = ["observation", "reward", "ending", "flags", "error"]
    head = f"{'gym':<10} {'cases':>6} {'steps':>6} " + " ".join(f"{k:>12}" for k in kinds)
    head += f" {'documented':>11} {'undocumented':>13}"
    lines = [head, "-" * len(head)]
    for gym, s in stats.items():
        mine = [d for d in diffs if d.gym == gym]
        counts = collections.Counter(d.kind for d in mine)
        undoc = sum(1 for d in mine if not d.documented)
        row = f"{gym:<10} {s['cases']:>6} {s['steps']:>6} " + " ".join(f"{counts[k]:>12}" for k in kinds)
        lines.append(row + f" {len(mine) - undoc:>11} {undoc:>13}")
    rows = collections.Counter(d.documented for d in diffs if d.documented)
    if rows:
        lines.append("")
        lines.append("documented differences by README row:")
        lines += [f"  {n:>6}  {row}" for row, n in rows.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--userrl", type=Path, required=True, help="a UserRL checkout (its gyms/ folder)")
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default: gyms.data_dir())")
    parser.add_argument("--gyms", default=",".join(STEPPERS), help="comma-separated gyms")
    parser.add_argument("--cases", type=int, default=40, help="cases (task + action sequence) per gym")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("diff_userrl.jsonl"), help="JSON lines, one per difference")
    args = parser.parse_args(argv)

    from gyms.data import data_dir as default_data_dir
    from userrl_megatron.config.schema import GymsConfig
    from userrl_megatron.data import load_tasks

    data_dir = args.data_dir or default_data_dir()
    _stub_gymnasium()
    stats: dict[str, dict[str, Any]] = {}
    diffs: list[Diff] = []
    wanted = args.gyms.split(",")
    unknown = [g for g in wanted if g not in STEPPERS]
    if unknown:
        raise SystemExit(f"not covered: {', '.join(unknown)}; covered gyms: {', '.join(STEPPERS)}")
    for gym in wanted:
        userrl = import_userrl(args.userrl, gym, data_dir)
        if gym == "search":
            install_search_fakes()
        gcfg = GymsConfig(data_dir=str(data_dir))
        tasks = [t for split in SPLITS.get(gym, ("train", "test")) for t in load_tasks([gym], split, gcfg)]
        rng = random.Random(f"{args.seed}:{gym}")
        stats[gym] = {"cases": 0, "steps": 0}
        for index in range(args.cases):
            task = tasks[index % len(tasks)] if index < len(tasks) else rng.choice(tasks)
            asyncio.run(run_case(gym, index, task, userrl, random.Random(f"{args.seed}:{gym}:{index}"), stats[gym],
                                 diffs))  # fmt: skip
    with args.out.open("w", encoding="utf-8") as f:
        for d in diffs:
            f.write(json.dumps(dataclasses.asdict(d), ensure_ascii=False) + "\n")
    print(summary(stats, diffs))
    print(f"\n{len(diffs)} differences written to {args.out}")
    return 1 if any(not d.documented for d in diffs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
