"""Fault injection for every LLM gym over real HTTP: 500, 429, timeouts, malformed JSON and empty replies are
retried, then counted as failures; the step answers with the gym's fallback and `StepResult.user_sim_error`,
reward 0, and the episode goes on (the next step works)."""

import asyncio
import json
import threading
from typing import Any

import pytest

import gyms
from tests.support.gym_play import SIM_TIMEOUT_S, sim_for
from tests.support.openai_server import FOREVER, Answer, Fault, OpenAIServer, Reply

STORY = {
    "new_title": "T",
    "new_surface": "S",
    "new_bottom": "B",
    "evaluation": [{"statement": "x", "score": 1.0}],
}
DETAILS = [{"description": "Length", "importance": "3", "inquiry": "How long?", "options": ["A week"]}]
# gym: (task, action, {system prompt marker: valid reply}, simulator calls the action makes)
CASES: dict[str, tuple[Any, str, dict[str, str], int]] = {
    "telepathy": (
        {"id": "e", "title": "Kiwi", "description": "A fruit.", "target_entity": "Kiwi", "category": "food"},
        "[action] Is it green?",
        {"game master": '{"response": "Yes"}'},
        1,
    ),
    "turtle": (STORY, "[action] Did she die?", {"You host": '{"response": "No"}'}, 1),
    "persuade": (
        {"id": "X", "claim": "C", "argument": "A"},
        "[answer] Because.",
        {"debate": '{"response": "Hm.", "stance": "Neutral"}'},
        1,
    ),
    "intention": (
        {"id": "i", "category": "Travel", "task": "Plan a trip.", "missing_details": DETAILS},
        "[action] How long?",
        {
            "You play a person": '{"response": "A week."}',
            "You judge": '{"is_task_related": true, "covered_detail_numbers": [1]}',
        },
        2,
    ),
    "search": (
        {"id": "b", "question": "Q?", "answer": "Romulus"},
        "[answer] Remus",
        {"You judge answers": '{"reasoning": "", "judgment": "No", "feedback": ""}'},
        1,
    ),
    "travel": (
        "flight:2-1|hotel:2-2",
        "[action] Hello!",
        {"You classify": '{"type": "1"}', "Reply briefly": '{"response": "Hi."}'},
        1,
    ),
}
FAULTS: dict[str, Reply] = {
    "http_500": Fault(500),
    "http_429": Fault(429, headers={"Retry-After": "0"}),
    "timeout": Answer('{"response": "late"}', delay_s=FOREVER),  # no reply while the test runs
    "malformed_json": "Sure! I think the answer is yes.",
    "empty": "",
}
RETRIES = 1
TIMEOUT_S = 0.3  # the client's timeout in the failing step of the "timeout" fault (elsewhere SIM_TIMEOUT_S)


@pytest.mark.parametrize("fault_name", list(FAULTS))
@pytest.mark.parametrize("gym_name", list(CASES))
def test_failed_simulator_calls_are_marked_and_the_episode_survives(gym_name: str, fault_name: str) -> None:
    task, action, replies, calls = CASES[gym_name]

    def valid(body: dict[str, Any]) -> str | None:
        system = body["messages"][0]["content"]
        return next((reply for marker, reply in replies.items() if marker in system), None)

    # The fault holds for the whole failing step, not for a count of requests: a client whose 0.3 s ran out
    # before its request was sent (a starved process) would leave a count's faults to the recovered step.
    failing = threading.Event()
    failing.set()
    attempts = calls * (RETRIES + 1)
    with OpenAIServer(lambda body: FAULTS[fault_name] if failing.is_set() else valid(body)) as server:
        sim = sim_for(server, max_retries=RETRIES, timeout_s=TIMEOUT_S if fault_name == "timeout" else SIM_TIMEOUT_S)
        gym = gyms.make_gym(gym_name, task, user_sim=sim)

        async def run() -> list[gyms.StepResult]:
            await gym.reset()
            failed = await gym.step(action)
            failing.clear()
            await sim.close()  # the next call opens a new client, with the timeout of a step that must succeed
            sim.cfg.timeout_s = SIM_TIMEOUT_S
            recovered = await gym.step(action)
            await sim.close()
            return [failed, recovered]

        failed, recovered = asyncio.run(run())
    assert failed.reward == 0.0 and not failed.ended
    assert failed.feedback == gym.failure_feedback(*gyms.parse_action(action))
    if gym_name == "search":  # UserRL's text for an answer its judge failed on
        assert failed.feedback == "Incorrect. Your answer 'Remus' is not correct."
    assert json.dumps(failed.user_sim_error).startswith(f'"user simulator failed after {RETRIES + 1} attempts')
    assert recovered.user_sim_error is None
    metrics = sim.metrics()
    assert (metrics["failures"], metrics["retries"]) == (calls, calls * RETRIES)
    recovering = 2 if gym_name == "travel" else calls  # travel: judge, then the reply
    if fault_name == "timeout":  # an attempt may time out before it is sent, or arrive after the step gave up
        assert recovering <= server.count <= attempts + recovering
    else:
        assert server.count == attempts + recovering
