"""`user_sim.structured`: the reply schema sent as response_format (on, auto) or not (off), and auto's one fallback
to free text when the endpoint refuses it; over real HTTP (the openai client against tests.support.openai_server)."""

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from gyms.reply_schema import ReplySchema, one_of, text
from gyms.user_sim import Reply, UserSimError, UserSimulator
from tests.support.openai_server import Fault, OpenAIServer, reply
from userrl_megatron.config.checks import check_config
from userrl_megatron.config.loader import ConfigError, load_config
from userrl_megatron.config.schema import UserSimConfig

PERSONA = ReplySchema(
    "persona", {"thought": text(), "response": text(), "stance": one_of(("Agree", "Disagree"))}, ("response", "stance")
)
MESSAGES = [{"role": "system", "content": "You are persuaded."}, {"role": "user", "content": "Consider this."}]
ANSWER = json.dumps({"thought": "hm", "response": "Fair point.", "stance": "Agree"})
# What the embedded engine answers before it has constrained decoding.
REFUSAL = Fault(
    400, '{"error": {"message": "response_format \'json_schema\' is not supported by the embedded server."}}'
)


def refuse_format(body: dict[str, Any]) -> Fault | None:
    return REFUSAL if "response_format" in body else None


def make_sim(server: OpenAIServer, structured: str) -> UserSimulator:
    cfg = UserSimConfig(base_url=server.base_url, model="sim", backoff_s=0.001, max_retries=2, structured=structured)
    cfg.api_key_env = "none"
    return UserSimulator(cfg)


def calls(sim: UserSimulator, n: int = 1, schema: Any = PERSONA, together: bool = False) -> list[Reply]:
    async def run() -> list[Reply]:
        try:
            if together:
                return list(await asyncio.gather(*(sim.chat(MESSAGES, json=True, schema=schema) for _ in range(n))))
            return [await sim.chat(MESSAGES, json=True, schema=schema) for _ in range(n)]
        finally:
            await sim.close()

    return asyncio.run(run())


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer(reply(ANSWER)) as s:
        yield s


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_the_call_asks_for_its_schema(server: OpenAIServer, mode: str) -> None:
    sim = make_sim(server, mode)
    [out] = calls(sim)
    assert out.data == {"thought": "hm", "response": "Fair point.", "stance": "Agree"}
    assert server.requests[0]["response_format"] == PERSONA.response_format()
    assert server.requests[0]["response_format"]["json_schema"]["schema"]["properties"]["stance"]["enum"] == [
        "Agree",
        "Disagree",
    ]
    metrics = sim.metrics()
    assert (metrics["structured"], metrics["structured_fallback"]) == (1.0, 0.0)


def test_free_text_fields_are_capped_when_asked(server: OpenAIServer) -> None:
    sim = make_sim(server, "on")
    sim.cfg.structured_text_chars = 120
    calls(sim)
    properties = server.requests[0]["response_format"]["json_schema"]["schema"]["properties"]
    assert properties["thought"] == properties["response"] == {"type": "string", "maxLength": 120}
    assert "maxLength" not in properties["stance"]  # an enum is short already


def test_a_reply_the_gym_cannot_use_is_counted_unusable() -> None:
    from gyms.turn_gym import TurnGym

    with OpenAIServer(reply('{"thought": "hm"}')) as server:  # parses, but lacks what the gym reads
        sim = make_sim(server, "on")

        async def ask() -> None:
            try:
                await TurnGym(1, sim).ask("You are persuaded.", "Consider this.", reply=PERSONA)
            finally:
                await sim.close()

        with pytest.raises(UserSimError, match="lacks response, stance"):
            asyncio.run(ask())
    metrics = sim.metrics()
    assert (metrics["calls"], metrics["answered"], metrics["failures"], metrics["unusable"]) == (1, 1, 0, 1)


def test_off_asks_for_free_text(server: OpenAIServer) -> None:
    sim = make_sim(server, "off")
    [out] = calls(sim)
    assert out.data is not None and out.data["stance"] == "Agree"
    assert "response_format" not in server.requests[0]
    assert sim.metrics()["structured"] == 0.0


@pytest.mark.parametrize("mode", ["on", "auto", "off"])
def test_a_call_without_a_schema_is_free_text(server: OpenAIServer, mode: str) -> None:
    """tau's customer (free text, no schema) is asked as before in every mode."""
    calls(make_sim(server, mode), schema=None)
    assert "response_format" not in server.requests[0]


def test_auto_falls_back_once_when_the_endpoint_refuses(server: OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    server.rules = [refuse_format, reply(ANSWER)]
    sim = make_sim(server, "auto")
    with caplog.at_level(logging.WARNING, logger="gyms.user_sim"):
        outs = calls(sim, 3)
    assert all(out.data is not None and out.data["stance"] == "Agree" for out in outs)
    # The first call is sent again without the format; the later ones never ask for it.
    assert ["response_format" in body for body in server.requests] == [True, False, False, False]
    warnings = [r for r in caplog.records if "refuses response_format" in r.getMessage()]
    assert len(warnings) == 1 and "not supported by the embedded server" in warnings[0].getMessage()
    metrics = sim.metrics(reset=True)
    assert (metrics["structured"], metrics["structured_fallback"], metrics["calls"]) == (0.0, 1.0, 3.0)
    assert (metrics["failures"], metrics["retries"], metrics["requests"]) == (0.0, 0.0, 4.0)
    after = sim.metrics()  # the next step's: the counter is the step's own, the state stays
    assert (after["structured"], after["structured_fallback"]) == (0.0, 0.0)


def test_calls_in_flight_fall_back_with_one_warning(server: OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    server.rules = [refuse_format, reply(ANSWER)]
    server.hold_until_in_flight = 4  # all four ask for the format before any refusal comes back
    sim = make_sim(server, "auto")
    with caplog.at_level(logging.WARNING, logger="gyms.user_sim"):
        outs = calls(sim, 4, together=True)
    assert all(out.data is not None for out in outs)
    assert sum("response_format" in body for body in server.requests) == 4
    assert len([r for r in caplog.records if "refuses response_format" in r.getMessage()]) == 1
    assert sim.metrics()["structured_fallback"] == 1.0


def test_auto_keeps_the_format_when_the_request_is_bad_anyway(server: OpenAIServer) -> None:
    """A 400 that the request without the format gets too is the request's fault: the call fails, no fallback."""
    server.rules = [reply(Fault(400, '{"error": {"message": "prompt too long"}}'))]
    sim = make_sim(server, "auto")
    with pytest.raises(UserSimError) as failed:
        calls(sim)
    assert failed.value.kind == "client"
    assert ["response_format" in body for body in server.requests] == [True, False]
    assert (sim.metrics()["structured"], sim.metrics()["structured_fallback"]) == (1.0, 0.0)


def test_on_fails_the_call_when_the_endpoint_refuses(server: OpenAIServer) -> None:
    server.rules = [refuse_format, reply(ANSWER)]
    sim = make_sim(server, "on")
    with pytest.raises(UserSimError, match=r"user_sim\.structured=on") as failed:
        calls(sim)
    assert failed.value.kind == "client" and server.count == 1
    assert sim.metrics()["structured"] == 1.0


def test_config_takes_auto_on_off_even_unquoted_in_yaml(tmp_path: Any) -> None:
    assert UserSimConfig().structured_mode == "auto"
    for written, mode in (("on", "on"), ("off", "off"), ("auto", "auto")):
        path = tmp_path / f"{written}.yaml"
        path.write_text(f"user_sim:\n  structured: {written}\n")  # YAML reads a bare on/off as a boolean
        cfg = load_config([path], check=False)
        check_config(cfg)
        assert cfg.user_sim.structured_mode == mode
        assert load_config([], [f"user_sim.structured={written}"]).user_sim.structured_mode == mode
    with pytest.raises(ConfigError, match=r"user_sim\.structured = 'sometimes'; choose from auto, on, off"):
        load_config([], ["user_sim.structured=sometimes"])


def test_the_eval_report_line_names_unusable_replies() -> None:
    from userrl_megatron.eval.results import simulator_calls

    counters = {"calls": 3.0, "answered": 3.0, "failures": 0.0, "retries": 0.0, "unusable": 1.0}
    assert simulator_calls(counters) == "3 (3 answered, 0 from the cache, 0 failed, 1 answered but unusable; 0 retries)"
