"""Random and hostile actions against every registered gym: each step stays within its budgets, never raises, and
never changes the gym's state when it answers with an error.

Actions mix the gym tags (and odd spellings of them) with payloads built to hurt: megabyte-scale text, long digit
strings, deep nesting, unicode (right-to-left marks, combining characters, lone surrogates, emoji), control
characters, malformed JSON tool calls, `<think>` floods, and tau `calculate` expressions whose naive evaluation
runs for minutes. The simulator is the real UserSimulator against the local test server, answering each request
with a reply chosen from the request's hash (valid replies and malformed ones alike), so a run is reproducible.

The bounds are sizes and counts, not clocks: feedback grows at most linearly with the action, a step makes at most
two simulator calls (each with its retries), rewards stay in [0, 1], and `calculate` never spends more than its work
budget. A generous 60 s per step (under 1 s on an idle machine) is only a safety net so that a regression fails
instead of hanging: a timer signal interrupts even a step stuck in one long computation (which `asyncio.wait_for`
alone cannot), with an exception no gym's `except Exception` can swallow.
"""

import asyncio
import contextlib
import copy
import hashlib
import json
import math
import random
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gyms
from gyms.base import StepResult
from gyms.search.settings import SearchGymConfig
from gyms.tau import arithmetic
from gyms.tau.settings import TauGymConfig
from gyms.tau.store import EpisodeDB
from gyms.tau.toolkit import calculate
from gyms.tau.user import Customer
from gyms.tau2.domain import Env
from gyms.tau2.settings import Tau2GymConfig
from gyms.tau2.user import Tau2User
from gyms.user_sim import UserSimulator
from tests.support.gym_play import sim_for
from tests.support.openai_server import OpenAIServer

SEED = 20261123
TELECOM_TASK = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"
STEPS_PER_GYM = 30
EPISODE_STEPS = 8
STEP_SAFETY_NET_S = 60.0

SLOW_EXPRESSIONS = [
    "(3**1048575)" + "*(3**1048575)" * 15,  # about a minute under eval
    "9**9**9**9",
    "2**2**2**2**2**2",
    "(2**65000)*(2**65000)*(2**65000)",
    "((3**41000)//(3**40999))" + "+(3**41000)//(3**40999)" * 60,
    "-" * 9000 + "1",
    "(" * 150 + "1" + ")" * 150 + "+1" * 4000,
    "1" * 4301,
    "1" + "0" * 9990 + ".5",
    " " * 9999 + "1",
    "1" + " " * 20_000,
]


def _unicode_soup(rng: random.Random) -> str:
    return "".join(rng.choices("é汉字\u202e\u0301\u200b\ufeff🙂\ud800İß\u00b2½", k=2000))


def _tool(rng: random.Random) -> str:
    return rng.choice(["calculate", "think", "get_order_details", "respond", "book_reservation", "nope"])


def _stored_deep_value(depth: int) -> str:
    """A retail call storing a list `depth` levels deep (deeper than the database hash can go from 600 on)."""
    address = ', "address2": "", "city": "c", "state": "s", "country": "x", "zip": "1"}}'
    deep = "[" * depth + "]" * depth
    return '{"name": "modify_user_address", "arguments": {"user_id": "yusuf_rossi_9620", "address1": ' + deep + address


PAYLOADS: list[Callable[[random.Random], str]] = [
    lambda rng: "",
    lambda rng: " " * 50_000,
    lambda rng: "9" * 100_000,
    lambda rng: "-9." * 20_000,
    lambda rng: " ".join(str(rng.randrange(10**6)) for _ in range(4)),
    lambda rng: " ".join("9" * 400 for _ in range(4)),
    lambda rng: "(" * 30_000,
    lambda rng: "[" * 20_000 + "]" * 20_000,
    lambda rng: '{"name": "think", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
    lambda rng: '{"name": "' + _tool(rng) + '", "arguments": {"expression": "' + rng.choice(SLOW_EXPRESSIONS) + '"}}',
    lambda rng: '{"name": "calculate", "arguments": {"expression": ' + "7" * 5000 + "}}",
    lambda rng: '{"name": "calculate", "arguments": {"expression": NaN}}',
    lambda rng: '{"name": "' + _tool(rng) + '", "arguments": {"content": ' + json.dumps(_unicode_soup(rng)) + "}}",
    lambda rng: (
        '{"name": "'
        + _tool(rng)
        + '", "arguments": {"order_id": "#W8955613", "item_ids": '
        + json.dumps(["x"] * 20000)
        + "}}"
    ),
    lambda rng: '{"name": "respond", "arguments": {"content": 5}}',
    lambda rng: _stored_deep_value(rng.choice([300, 600, 900])),
    lambda rng: '{"name": "transfer_to_human_agents", "arguments": {"summary": "bye"}}',
    lambda rng: '{"name": "' + _tool(rng) + '", "arguments": ',
    lambda rng: _tool(rng) + ': {"thought": "' + "x" * 50_000 + '"',
    lambda rng: "<think>" * 15_000 + "</think>",
    lambda rng: "[answer] " * 10_000,
    _unicode_soup,
    lambda rng: "".join(chr(rng.randrange(0, 32)) for _ in range(500)) + "\x7f\x1b[31m",
    lambda rng: "H1, F3, C2, " * 5000,
    lambda rng: rng.choice(["h1", "H1", "F1", "test", "tools", "help", "kiwi", "Romulus"]),
    lambda rng: json.dumps({"choice": "answer", "content": _unicode_soup(rng)}),
]


TAGS = ["[action] ", "[answer] ", "[search] ", "", "[ANSWER]", "  [search]", "[finish] ", "[think] "]


def slow_calculation(rng: random.Random) -> str:
    return '{"name": "calculate", "arguments": {"expression": "' + rng.choice(SLOW_EXPRESSIONS) + '"}}'


def actions(rng: random.Random, n: int, tools: bool) -> list[str]:
    """`n` actions; with `tools` (the tau gyms) half of them are `[answer]` tool calls, a third of those `calculate`."""
    out = []
    for _ in range(n):
        tag = rng.choice(TAGS[:-2]) if rng.random() < 0.97 else rng.choice(TAGS[-2:])
        payload = rng.choice(PAYLOADS)(rng)
        if tools and rng.random() < 0.5:
            tag, payload = (
                "[answer] ",
                slow_calculation(rng) if rng.random() < 0.35 else rng.choice(PAYLOADS[8:19])(rng),
            )
        if rng.random() < 0.3:  # cut a payload short anywhere: broken JSON, split surrogate pairs, half a tag
            payload = payload[: rng.randrange(len(payload) + 1)]
        out.append(tag + payload)
    return out


def sim_reply(body: dict[str, Any]) -> str:
    """A reply picked from the request's hash: valid for every gym's prompt, or malformed in a known way."""
    digest = hashlib.sha256(json.dumps(body["messages"], ensure_ascii=True).encode()).digest()
    valid = {
        "thought": "",
        "response": "Yes",
        "judgment": "Yes",
        "feedback": "ok",
        "reasoning": "",
        "stance": "Partly Agree",
        "scores": [{"statement": f"s{i}", "thought": "", "score": 0.5} for i in range(3)],
        "analysis": "",
        "is_task_related": True,
        "covered_detail_numbers": [1, 2, 2],
        "alignment_judgement": "True",
        "alignment_aspect": "hotel",
        "type": "2",
        "preference_id": "P3",
        "message": "I need help.",  # the tau2 user with tools: a message to the agent
        "tool_call": None,
    }
    replies = [
        json.dumps(valid),
        json.dumps({**valid, "judgment": "No", "stance": "Strongly Disagree", "type": "1"}),
        json.dumps({**valid, "stance": "agree", "judgment": "yes", "scores": [1, "0.5", 0]}),
        json.dumps({**valid, "covered_detail_numbers": ["²", -1, True], "is_task_related": "false"}),
        json.dumps({**valid, "alignment_judgement": "N/A", "type": "4"}),
        "no JSON here ###STOP###",
        "```json\n{" + '"response": "unterminated',
        "<think>" * 200 + json.dumps(valid),
        "I'd like to exchange an item. " * 50,
        '{"response": ' + "9" * 5000 + "}",  # digits over Python's limit
        "{[1]: 2} " + "{" * 3000,  # an unbuildable literal, then unbalanced braces
        '{"response": ' * 3000 + "1",
        "###STOP###",
    ]
    return replies[digest[0] % len(replies)]


def records(shared_data: Path, corpus: Path) -> dict[str, tuple[Any, Any]]:
    """(task, config) of one episode per gym."""
    rubric = [{"statement": f"s{i}", "score": w} for i, w in enumerate((0.7, 0.2, 0.1))]
    details = [
        {"description": f"d{i}", "importance": str(1 + i % 3), "inquiry": "?", "options": ["a"]} for i in range(4)
    ]
    tau = TauGymConfig(data_dir=str(shared_data))
    tau2 = Tau2GymConfig(data_dir=str(shared_data))
    return {
        "echo": ({"id": "echo-fuzz-0", "targets": ["a", "b", "a"]}, None),
        "function": (
            {"id": "f", "rule": "(c + b) ** 2 - a / d", "test_case": [9, 7, 4, 2], "expected_result": 117.5},
            None,
        ),
        "intention": ({"id": "i", "category": "Travel", "task": "Plan a trip.", "missing_details": details}, None),
        "persuade": ({"id": "p", "claim": "Dogs are better.", "argument": "Loyalty."}, None),
        "search": (
            {"id": "s", "question": "Who founded Rome?", "answer": "Romulus"},
            SearchGymConfig(corpus_path=str(corpus)),
        ),
        "telepathy": ({"id": "t", "description": "A fruit.", "target_entity": "Kiwi", "category": "food"}, None),
        "travel": ("flight:2-5|hotel:3-6", None),
        "turtle": ({"new_title": "T", "new_surface": "S", "new_bottom": "B", "evaluation": rubric}, None),
        "tau": ("retail-016", tau),
        "tau_retail": ("retail-000", tau),
        "tau_airline": ("airline-003", tau),
        "tau2_mock": ("update_task_with_user_tools", tau2),
        "tau2_mock_chat": ("update_task_with_user_tools", tau2),
        "tau2_airline": ("3", tau2),
        "tau2_retail": ("24", tau2),
        "tau2_telecom": (TELECOM_TASK, tau2),
        "tau2_telecom_solo": (TELECOM_TASK, tau2),
    }


SKIPPED_STATE = {"user_sim", "config", "record", "rule", "domain", "task", "backend", "scenario", "rubric", "steps"}
SKIPPED_STATE |= {"ended", "max_steps", "expected", "test_case", "targets", "opening", "needs_user_sim"}
# SearchGym counts every search action, empty or over the limit (as UserRL); TravelGym records a failed exchange in
# its dialogue history and counts a search whose judge failed (as UserRL); the tau2 gyms keep every tool call in their
# trajectory, failed ones too, since tau2's ACTION check matches gold actions against all of them (SPEC.md §9.2),
# and count tool errors toward tau2's too_many_errors ending
TAU2_CHAT = ("tau2_mock_chat", "tau2_airline", "tau2_retail", "tau2_telecom")
TAU2_COUNTING = ("tau2_mock", "tau2_telecom_solo", *TAU2_CHAT)
COUNTERS = {"search": {"searches"}, **{name: {"calls", "errors"} for name in TAU2_COUNTING}}
SIM_ERROR_STATE = {"travel": {"history", "searches"}}
ERROR_FEEDBACK = (
    "Invalid",
    "Please",
    "Error",
    "Unknown action",
    "Search not supported",
    "Search content should",
    "This is the test case",
    "The function cannot",
    "This trip has no",
    "You have already recommended",
    "You have reached the maximum",
)


class StepTimeout(BaseException):
    """A step ran past the safety net (a BaseException: a gym's `except Exception` cannot swallow it)."""


@contextlib.contextmanager
def safety_net(seconds: float) -> Iterator[None]:
    """Raise StepTimeout in the main thread after `seconds`, between any two bytecodes."""

    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"a step ran past the {seconds} s safety net")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def deep_values() -> Iterator[None]:
    """Room for the 900-deep values the fuzz sends (a tau database stores them; the gym itself scores those 0)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _deep_hash(db: EpisodeDB) -> str:
    with deep_values():
        return db.hash()


def fingerprint(gym: Any) -> dict[str, Any]:
    """The gym's mutable episode state, comparable with ==."""
    out = {}
    for key, value in vars(gym).items():
        if key in SKIPPED_STATE:
            continue
        if isinstance(value, random.Random):
            value = value.getstate()
        elif isinstance(value, EpisodeDB):
            value = _deep_hash(value)
        elif isinstance(value, Env):
            value = [_deep_hash(db) for db in (value.db, value.user_db) if db is not None]
        elif isinstance(value, Customer | Tau2User):
            value = copy.deepcopy(value.history)
        else:
            with deep_values():  # tau2_mock's trajectory keeps the arguments of every call
                value = copy.deepcopy(value)
        out[key] = value
    return out


def is_error(result: StepResult) -> bool:
    return (
        result.user_sim_error is not None
        or "search_error" in result.info
        or (result.reward == 0.0 and not result.done and result.feedback.startswith(ERROR_FEEDBACK))
    )


async def fuzz_gym(
    name: str, task: Any, config: Any, sim: UserSimulator, server: OpenAIServer, seed: int
) -> dict[str, int]:
    """Play STEPS_PER_GYM hostile actions on gym `name`; counts the steps that answered with an error, and those
    that `calculate` refused over a budget."""
    rng = random.Random(f"{seed}:{name}")
    spec = gyms.gym_spec(name)
    cfg = gyms.config_for(name, _gyms_cfg(spec.config_field, config), EPISODE_STEPS)
    gym = gyms.make_gym(name, task, config=cfg, user_sim=sim)
    await gym.reset()
    counts = {"errors": 0, "over_budget": 0}
    for action in actions(rng, STEPS_PER_GYM, tools=name.startswith("tau")):
        before, requests = fingerprint(gym), server.count
        with safety_net(STEP_SAFETY_NET_S):
            result = await asyncio.wait_for(gym.step(action), STEP_SAFETY_NET_S)
        assert isinstance(result, StepResult) and isinstance(result.feedback, str), (name, action[:80])
        assert math.isfinite(result.reward) and 0.0 <= result.reward <= 1.0, (name, result)
        assert isinstance(result.info, dict) and result.info["step"] >= 1
        assert len(result.feedback) <= 2 * len(action) + 60_000, (name, action[:80])
        assert server.count - requests <= 2 * (1 + sim.cfg.max_retries), (name, action[:80])
        if result.feedback.startswith(("Error: int too large", "Error: expression longer", "Error: maximum recursion")):
            counts["over_budget"] += 1
        if is_error(result):
            counts["errors"] += 1
            after, before = fingerprint(gym), dict(before)
            ignored = COUNTERS.get(name, set()) | (
                SIM_ERROR_STATE.get(name, set()) if result.user_sim_error is not None else set()
            )
            for key in ignored:
                after.pop(key, None), before.pop(key, None)
            assert after == before, (name, action[:120], result.feedback[:200])
        if result.ended:
            await gym.reset()
    await gym.close()
    return counts


def _gyms_cfg(field: str, config: Any) -> Any:
    from userrl_megatron.config.schema import GymsConfig

    cfg = GymsConfig()
    if config is not None:
        setattr(cfg, field, config)
    return cfg


def test_every_gym_survives_hostile_actions(shared_data: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"title": f"doc {i}", "text": f"Romulus founded Rome {i}"}) + "\n" for i in range(50))
    )
    tasks = records(shared_data, corpus)
    assert set(tasks) == set(gyms.list_gyms()), "a new gym needs a fuzz record here"

    async def run(server: OpenAIServer) -> dict[str, dict[str, int]]:
        sim = sim_for(server, max_retries=1)
        try:
            return {
                name: await fuzz_gym(name, task, config, sim, server, SEED) for name, (task, config) in tasks.items()
            }
        finally:
            await sim.close()

    with OpenAIServer(sim_reply) as server:
        counts = asyncio.run(run(server))
    assert all(c["errors"] > 0 for name, c in counts.items() if name != "echo"), counts  # echo refuses nothing
    assert all(counts[name]["over_budget"] > 0 for name in ("tau", "tau_retail", "tau_airline")), counts


@settings(
    max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.text(alphabet="0123456789+-*/(). ", max_size=40))
def test_calculate_agrees_with_eval_and_stays_within_budget(expression: str) -> None:
    """Random strings over tau-bench's alphabet: eval's answer wherever eval is quick, and a bounded work count."""
    budget = arithmetic.Budget()
    with contextlib.suppress(Exception):  # only the budget matters here; the text is compared below
        arithmetic.evaluate(expression, budget)
    assert budget.spent <= budget.limit
    if "**" in expression:  # eval could run for hours on a short power tower
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "'int' object is not callable; perhaps you missed a comma?"
        try:
            expected = str(round(float(eval(expression.lstrip(" "), {"__builtins__": None}, {})), 2))
        except Exception as e:
            expected = f"Error: {e}"
    assert calculate(None, expression) == expected


@pytest.mark.parametrize("expression", SLOW_EXPRESSIONS, ids=[str(i) for i in range(len(SLOW_EXPRESSIONS))])
def test_slow_expressions_stay_within_budget(expression: str) -> None:
    budget = arithmetic.Budget()
    with contextlib.suppress(OverflowError, SyntaxError, MemoryError, RecursionError, ValueError):
        arithmetic.evaluate(expression, budget)
    assert budget.spent <= budget.limit
    assert calculate(None, expression).startswith(("Error: ", "inf", "1.0"))
