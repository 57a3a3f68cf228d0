"""The tau gyms' simulated customer over real HTTP: the real UserSimulator against the local test server."""

import asyncio
import json

import pytest

from gyms.base import make_gym
from gyms.tau.domain import load_domain
from gyms.tau.settings import TauGymConfig
from gyms.tau.tasks import parse_task_id
from gyms.tau.user import GREETING, customer_prompt
from gyms.turn_gym import TurnGym
from gyms.user_sim import UserSimulator
from tests.support.gym_play import SIM_TIMEOUT_S
from tests.support.openai_server import Fault, OpenAIServer, reply
from userrl_megatron.config.schema import UserSimConfig


def _last_message_is(text, answer):
    return lambda body: answer if body["messages"][-1]["content"] == text else None


def _run(gym_name, task_id, actions, server, shared_data, gym_config=None, **sim_overrides):
    """Play `actions` on a fresh gym with a UserSimulator pointed at `server`; the step results."""
    cfg = UserSimConfig(
        base_url=server.base_url, model="customer", timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=1
    )
    cfg.api_key_env = "none"  # our local server needs no key
    for key, value in sim_overrides.items():
        setattr(cfg, key, value)

    async def run():
        sim = UserSimulator(cfg)
        config = gym_config or TauGymConfig(data_dir=str(shared_data))
        gym = make_gym(gym_name, task_id, config=config, user_sim=sim)
        try:
            await gym.reset()
            return gym, [await gym.step(a) for a in actions]
        finally:
            await gym.close()
            await sim.close()

    return asyncio.run(run())


def _gold(shared_data, task_id):
    domain, split, index = parse_task_id(task_id)
    task = load_domain(domain, str(shared_data / "taubench")).task(split, index)
    return task, ["[answer] " + json.dumps({"name": a["name"], "arguments": a["kwargs"]}) for a in task.actions]


def test_tau_messages_reach_the_customer_and_stop_ends_with_the_reward(shared_data):
    task, gold = _gold(shared_data, "retail-000")
    with OpenAIServer(
        _last_message_is("May I have your name and zip code?", "Yusuf Rossi, 19122."),
        _last_message_is("Both exchanges are submitted.", "Great, thanks! ###STOP###"),
    ) as server:
        gym, results = _run(
            "tau",
            "retail-000",
            ["[action] May I have your name and zip code?", *gold, "[action] Both exchanges are submitted."],
            server,
            shared_data,
        )
        first_request = server.requests[0]
    assert results[0].feedback == "Yusuf Rossi, 19122." and results[0].reward == 0.0 and not results[0].done
    assert first_request["model"] == "customer"
    assert "temperature" not in first_request and "max_tokens" not in first_request  # as tau-bench's requests
    assert first_request["messages"] == [
        {"role": "system", "content": customer_prompt(task.instruction)},
        {"role": "user", "content": GREETING},
        {"role": "assistant", "content": gym.opening},
        {"role": "user", "content": "May I have your name and zip code?"},
    ]
    assert task.instruction in first_request["messages"][0]["content"]
    last = results[-1]
    assert (last.feedback, last.reward, last.done) == ("Great, thanks! ###STOP###", 1.0, True)
    assert last.info["reward_info"]["r_actions"] == 1.0
    assert [m["role"] for m in gym.customer.history] == ["system", "user", "assistant"] + ["user", "assistant"] * 2


def test_customer_sampling_parameters_are_sent_only_when_configured(shared_data):
    config = TauGymConfig(data_dir=str(shared_data), customer_temperature=0.7, customer_max_tokens=128)
    with OpenAIServer(reply("Hello.")) as server:
        _run("tau_retail", "retail-000", ["[action] Hi"], server, shared_data, gym_config=config, temperature=0.0)
        request = server.requests[0]
    assert (request["temperature"], request["max_tokens"]) == (0.7, 128)


@pytest.mark.parametrize(
    ("gym_name", "task_id"), [("tau", "retail-000"), ("tau_retail", "retail-train-001"), ("tau_airline", "airline-003")]
)
def test_simulator_failure_gives_the_fallback_with_reward_0_and_is_flagged(shared_data, gym_name, task_id):
    with OpenAIServer(reply(Fault(500))) as server:
        gym, results = _run(gym_name, task_id, ["[action] Hello?"], server, shared_data)
        assert server.count == 2  # one retry, then the call failed for good
    failed = results[0]
    assert (failed.feedback, failed.reward, failed.done) == (TurnGym.fallback_feedback, 0.0, False)
    assert "HTTP 500" in failed.user_sim_error
    assert len(gym.customer.history) == 3  # the failed exchange left no trace in the customer's history


def test_a_recovered_simulator_continues_the_conversation(shared_data):
    calls = iter([Fault(503), Fault(503), "I want to exchange two items.", "###STOP###"])
    with OpenAIServer(lambda body: next(calls)) as server:
        _, results = _run(
            "tau", "retail-000", ["[action] Hello?", "[action] Hello again?", "[action] Done."], server, shared_data
        )
        assert len(server.requests[-1]["messages"]) == 6  # system, greeting, opening, "Hello again?", reply, "Done."
    assert results[0].user_sim_error is not None
    assert results[1].feedback == "I want to exchange two items."
    assert (results[2].reward, results[2].done) == (0.0, True)  # the exchanges were never made: reward 0
    assert results[2].info["reward_info"]["r_actions"] == 0.0


@pytest.mark.parametrize("gym_name", ["tau", "tau_retail"])
def test_a_gym_cannot_be_built_without_a_simulator(shared_data, gym_name):
    with pytest.raises(ValueError, match=f"gym {gym_name} needs a user simulator"):
        make_gym(gym_name, "retail-000", config=TauGymConfig(data_dir=str(shared_data)))


@pytest.mark.parametrize(
    ("gym_name", "task_id", "message"),
    [
        ("tau_retail", "retail-002", "There are 10 t-shirt options; your return is requested."),
        ("tau_airline", "airline-002", "Your refund comes to 23,553 dollars in total."),
    ],
)
def test_domain_gyms_solve_a_task_with_the_required_output_over_http(shared_data, gym_name, task_id, message):
    task, gold = _gold(shared_data, task_id)
    with OpenAIServer(_last_message_is(message, "###STOP###"), reply("Could you check again?")) as server:
        _, results = _run(
            gym_name, task_id, ["[action] Hi, let me look into it.", *gold, f"[action] {message}"], server, shared_data
        )
    assert results[0].feedback == "Could you check again?"
    assert [r.reward for r in results] == [0.0] * (len(gold) + 1) + [1.0]
    assert results[-1].info["reward_info"]["outputs"] == dict.fromkeys(task.outputs, True)
