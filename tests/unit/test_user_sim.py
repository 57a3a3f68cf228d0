"""UserSimulator over real HTTP (the real openai client against tests.support.openai_server)."""

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyms.reply_json import extract_json_object, strip_think
from gyms.user_sim import Reply, UserSimError, UserSimulator, reply_bytes_cap
from tests.support.gym_play import SIM_TIMEOUT_S
from tests.support.openai_server import FOREVER, Answer, Fault, OpenAIServer, fail_first, reply, sequence, when
from userrl_megatron.config.schema import UserSimConfig

MESSAGES = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Hi"}]


def make_sim(server: OpenAIServer, **overrides: object) -> UserSimulator:
    cfg = UserSimConfig(base_url=server.base_url, model="sim", timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=3)
    cfg.api_key_env = "none"  # our local server needs no key
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return UserSimulator(cfg)


def chat(sim: UserSimulator, **kwargs: object) -> Reply:
    async def run() -> Reply:
        try:
            return await sim.chat(MESSAGES, **kwargs)
        finally:
            await sim.close()

    return asyncio.run(run())


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


def test_reply_usage_and_metrics(server: OpenAIServer) -> None:
    server.rules = [reply(Answer("Hello there", prompt_tokens=12, completion_tokens=3))]
    sim = make_sim(server, temperature=0.3, max_tokens=99)
    out = chat(sim)
    assert (out.text, out.data, out.usage.prompt_tokens, out.usage.completion_tokens) == ("Hello there", None, 12, 3)
    assert out.latency_s > 0 and not out.cached
    assert server.requests[0] == {"model": "sim", "messages": MESSAGES, "temperature": 0.3, "max_tokens": 99}
    m = sim.metrics()
    assert {k: m[k] for k in ("calls", "requests", "failures", "retries", "prompt_tokens", "completion_tokens")} == {
        "calls": 1.0,
        "requests": 1.0,
        "failures": 0.0,
        "retries": 0.0,
        "prompt_tokens": 12.0,
        "completion_tokens": 3.0,
    }
    assert m["latency_mean_s"] == pytest.approx(out.latency_s) and m["latency_max_s"] == pytest.approx(out.latency_s)
    assert m["latency_p50_s"] == m["latency_p99_s"] == pytest.approx(out.latency_s)
    assert m["cache_hit_rate"] == 0.0


def test_latency_percentiles_are_nearest_rank() -> None:
    from gyms.user_sim import _percentile

    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert (_percentile(values, 0.5), _percentile(values, 0.99), _percentile(values[:1], 0.99)) == (50.0, 99.0, 1.0)
    assert _percentile([], 0.5) == 0.0


def test_per_call_overrides_and_thinking_switch(server: OpenAIServer) -> None:
    server.rules = [reply("ok")]
    chat(make_sim(server, disable_thinking=True), temperature=0.9, max_tokens=5)
    body = server.requests[0]
    assert (body["temperature"], body["max_tokens"]) == (0.9, 5)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


def test_api_key_comes_from_the_named_environment_variable(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.rules = [reply("ok")]
    monkeypatch.setenv("SIM_TEST_KEY", "sk-from-env")
    chat(make_sim(server, api_key_env="SIM_TEST_KEY"))
    assert server.headers[0]["Authorization"] == "Bearer sk-from-env"


def test_json_reply_with_thinking_and_fence(server: OpenAIServer) -> None:
    server.rules = [reply('<think>let me see {"no": 1}</think>Sure:\n```json\n{"judgment": "Yes", "ok": true}\n```')]
    out = chat(make_sim(server), json=True)
    assert out.data == {"judgment": "Yes", "ok": True}
    assert out.text.startswith("Sure:")


@pytest.mark.parametrize("fault", [Fault(500), Fault(503), Fault(429), Fault(408), Fault(drop=True)])
def test_transient_faults_are_retried(server: OpenAIServer, fault: Fault) -> None:
    server.rules = [fail_first(2, fault, then=reply("fine"))]
    sim = make_sim(server)
    assert chat(sim).text == "fine"
    assert server.count == 3
    m = sim.metrics()
    assert (m["retries"], m["failures"], m["requests"]) == (2.0, 0.0, 3.0)


def test_timeouts_retry_then_fail_with_a_typed_error(server: OpenAIServer) -> None:
    server.rules = [reply(Answer("late", delay_s=FOREVER))]
    sim = make_sim(server, timeout_s=0.1, max_retries=2)
    with pytest.raises(UserSimError, match=r"user simulator failed after 3 attempts: no reply within 0\.1 s") as e:
        chat(sim)
    assert (e.value.kind, e.value.attempts) == ("timeout", 3)
    m = sim.metrics()
    assert (m["requests"], m["retries"], m["failures"]) == (3.0, 2.0, 1.0)
    assert (m["retries/timeout"], m["failures/timeout"]) == (2.0, 1.0)  # also counted by kind


def test_retarget_sends_the_next_calls_to_a_new_address(server: OpenAIServer) -> None:
    """A simulator engine restarted at a new address: the client follows it (the run's own engines)."""
    server.rules = [reply("from the first")]
    with OpenAIServer() as second:
        second.rules = [reply("from the second")]
        sim = make_sim(server)

        async def run() -> list[str]:
            first = await sim.chat(MESSAGES)
            await sim.retarget(second.base_url)
            then = await sim.chat(MESSAGES)
            await sim.close()
            return [first.text, then.text]

        assert asyncio.run(run()) == ["from the first", "from the second"]
        assert (len(server.requests), len(second.requests)) == (1, 1)


def test_malformed_json_is_retried_then_accepted(server: OpenAIServer) -> None:
    server.rules = [sequence("I think yes.", '{"response": "Yes"}')]
    sim = make_sim(server)
    assert chat(sim, json=True).data == {"response": "Yes"}
    assert sim.metrics()["retries"] == 1.0


def test_persistently_malformed_or_empty_replies_fail(server: OpenAIServer) -> None:
    for content, kind in [("no json here", "bad_json"), ("", "empty"), ("<think>only thinking</think>", "empty")]:
        server.rules = [reply(content)]
        sim = make_sim(server, max_retries=1)
        with pytest.raises(UserSimError) as e:
            chat(sim, json=True)
        assert e.value.kind == kind
        assert sim.metrics()["failures"] == 1.0


def test_an_over_long_reply_is_a_counted_failure(server: OpenAIServer) -> None:
    """A reply over `max_reply_chars` (thinking included) never reaches the episode: one request, no retry."""
    server.rules = [reply("<think>" + "x" * 60 + "</think>short")]
    sim = make_sim(server, max_reply_chars=64)
    with pytest.raises(UserSimError) as e:
        chat(sim)
    assert str(e.value) == "user simulator reply of 80 characters is longer than user_sim.max_reply_chars (64)"
    assert (e.value.kind, e.value.attempts, server.count) == ("too_long", 1, 1)
    m = sim.metrics()
    assert (m["failures"], m["retries"], m["answered"]) == (1.0, 0.0, 0.0)
    server.rules = [reply("y" * 64)]
    assert chat(make_sim(server, max_reply_chars=64)).text == "y" * 64


def test_client_errors_are_not_retried(server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server.rules = [reply(Fault(400, '{"error": {"message": "bad model"}}'))]
    sim = make_sim(server)
    with pytest.raises(UserSimError, match="user simulator request rejected: HTTP 400") as e:
        chat(sim)
    assert (e.value.kind, server.count, sim.metrics()["retries"]) == ("client", 1, 0.0)
    server.rules = [reply(Fault(401, '{"error": {"message": "no key"}}'))]
    monkeypatch.setenv("SIM_TEST_KEY", "sk-revoked")
    with pytest.raises(UserSimError, match=r"HTTP 401 \(is \$SIM_TEST_KEY set\?\)"):
        chat(make_sim(server, api_key_env="SIM_TEST_KEY"))


def test_a_missing_key_is_a_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from userrl_megatron.errors import UserError

    monkeypatch.delenv("SIM_MISSING_KEY", raising=False)
    with pytest.raises(UserError, match=r"user_sim.api_key_env names \$SIM_MISSING_KEY, which is not set.*=none"):
        UserSimulator(UserSimConfig(api_key_env="SIM_MISSING_KEY"))
    monkeypatch.setenv("SIM_MISSING_KEY", "")
    with pytest.raises(UserError, match="which is not set"):
        UserSimulator(UserSimConfig(api_key_env="SIM_MISSING_KEY"))


def test_garbage_200_body_is_retried(server: OpenAIServer) -> None:
    server.rules = [fail_first(1, Fault(200, "this is not json"), then=reply("good"))]
    sim = make_sim(server)
    assert chat(sim).text == "good"
    assert sim.metrics()["retries"] == 1.0


def test_unreachable_endpoint_is_a_connection_failure() -> None:
    with OpenAIServer() as s:
        url = s.base_url
    cfg = UserSimConfig(base_url=url, api_key_env="none", timeout_s=SIM_TIMEOUT_S, backoff_s=0.001, max_retries=1)
    sim = UserSimulator(cfg)
    with pytest.raises(UserSimError) as e:
        chat(sim)
    assert e.value.kind == "connection"


@pytest.mark.parametrize("backend", ["aiohttp", "httpx"])
def test_a_dropped_connection_is_a_connection_failure(server: OpenAIServer, backend: str) -> None:
    """A server that dies mid-request closes the connection: not a timeout (the aiohttp transport reports it as
    one), so a managed client waits for the engine's restart before retrying (`reconnect`)."""
    server.rules = [reply(Fault(drop=True))]
    with pytest.raises(UserSimError, match="cannot reach") as e:
        chat(make_sim(server, max_retries=0, http_backend=backend))
    assert e.value.kind == "connection"


def test_a_call_that_cannot_reach_the_endpoint_waits_for_reconnect_not_a_backoff(server: OpenAIServer) -> None:
    """The run's simulator engine restarted at a new address: the retry waits until `reconnect` returns (the
    pool's restart, however long it takes) instead of a backoff, and goes to the new address. The backoff here is
    an hour, so a retry that slept it would not finish."""
    with OpenAIServer() as gone:
        dead_url = gone.base_url
    server.rules = [reply("back")]
    sim = make_sim(server, base_url=dead_url, max_retries=1, backoff_s=3600.0, backoff_max_s=3600.0)
    restarts: list[str] = []

    async def reconnect() -> None:
        restarts.append(sim.cfg.base_url)
        await sim.retarget(server.base_url)  # what the pool's restart hook does for a new address

    sim.reconnect = reconnect

    async def run() -> Reply:
        try:
            async with asyncio.timeout(SIM_TIMEOUT_S):  # only a retry that slept its backoff reaches it
                return await sim.chat(MESSAGES)
        finally:
            await sim.close()

    assert asyncio.run(run()).text == "back" and restarts == [dead_url]
    m = sim.metrics()
    assert (m["requests"], m["retries/connection"], m["failures"], m["answered"]) == (2.0, 1.0, 0.0, 1.0)


def test_a_call_whose_endpoint_is_not_coming_back_fails_at_once() -> None:
    with OpenAIServer() as gone:
        dead_url = gone.base_url
    sim = UserSimulator(UserSimConfig(base_url=dead_url, api_key_env="none", max_retries=3, backoff_s=3600.0))

    async def given_up() -> None:
        raise RuntimeError("every engine of the rollout pool failed and was given up")

    sim.reconnect = given_up
    with pytest.raises(UserSimError, match="it is not coming back: every engine of the rollout pool") as e:
        chat(sim)
    assert (e.value.kind, e.value.attempts) == ("connection", 1)
    m = sim.metrics()
    assert (m["requests"], m["retries"], m["failures/connection"]) == (1.0, 0.0, 1.0)


def test_concurrency_is_bounded(server: OpenAIServer) -> None:
    server.rules = [reply("ok")]
    server.hold_until_in_flight = 3  # replies wait until 3 are in flight together, however slowly they are sent
    sim = make_sim(server, max_concurrency=3)

    async def run() -> list[str]:
        replies = await asyncio.gather(*(sim.chat(MESSAGES) for _ in range(12)))
        await sim.close()
        return [r.text for r in replies]

    assert asyncio.run(run()) == ["ok"] * 12
    assert server.max_in_flight == 3 and sim.metrics()["in_flight_max"] == 3.0


def test_response_cache_replays_without_requests(server: OpenAIServer, tmp_path: Path) -> None:
    server.rules = [sequence('{"n": 1}', '{"n": 2}', '{"n": 3}')]
    sim = make_sim(server, cache_dir=str(tmp_path))
    first, second = chat(sim, json=True), chat(sim, json=True)
    assert (first.data, second.data, second.cached, server.count) == ({"n": 1}, {"n": 1}, True, 1)
    assert chat(sim, json=True, temperature=0.5).data == {"n": 2}  # another request, another key
    fresh = make_sim(server, cache_dir=str(tmp_path))  # a new process reads the same files
    assert chat(fresh, json=True).data == {"n": 1} and server.count == 2
    m = sim.metrics()
    assert (m["calls"], m["cache_hits"], m["requests"], m["answered"]) == (3.0, 1.0, 2.0, 2.0)


def test_failed_calls_are_not_cached(server: OpenAIServer, tmp_path: Path) -> None:
    server.rules = [sequence(Fault(500), "ok")]
    sim = make_sim(server, cache_dir=str(tmp_path), max_retries=0)
    with pytest.raises(UserSimError):
        chat(sim)
    assert chat(sim).text == "ok" and sim.metrics()["cache_hits"] == 0.0


def test_one_simulator_serves_several_event_loops(server: OpenAIServer) -> None:
    server.rules = [reply("ok")]
    sim = make_sim(server)
    assert [chat(sim).text for _ in range(3)] == ["ok"] * 3


def test_backoff_is_exponential_with_jitter_and_capped() -> None:
    sim = UserSimulator(UserSimConfig(api_key_env="none", backoff_s=1.0, backoff_max_s=5.0))
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)]:
        delays = [sim._backoff(attempt) for _ in range(200)]
        assert all(0.5 * base <= d < 1.5 * base for d in delays)
        assert max(delays) - min(delays) > 0.1 * base  # jittered


def test_metrics_reset(server: OpenAIServer) -> None:
    server.rules = [when("Hi", "hello")]
    sim = make_sim(server)
    chat(sim)
    assert sim.metrics(reset=True)["calls"] == 1.0
    assert sim.metrics()["calls"] == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('```json\n{"a": true, "b": null}\n```', {"a": True, "b": None}),
        ('```\n{"a": false}\n```\nHope this helps', {"a": False}),
        ('Here you go: {"a": {"b": [1, 2]}} and more text {"c": 3}', {"a": {"b": [1, 2]}}),
        ("{'thought': 'single quotes', 'ok': True}", {"thought": "single quotes", "ok": True}),
        ('{"ok": True, "text": "python-ish"}', {"ok": True, "text": "python-ish"}),
        ('<think>{"wrong": 1}</think>{"right": 2}', {"right": 2}),
        ('reasoning without opening tag</think>\n{"right": 3}', {"right": 3}),
        ('{"text": "a } brace"} trailing', {"text": "a } brace"}),
        # xgrammar 0.2.7 compiles a string with maxLength to `[^"\\\r\n]{0,N}` (print
        # `xgrammar.Grammar.from_json_schema('{"type": "string", "maxLength": 9}')`): a constrained reply may hold
        # raw control characters, which strict JSON refuses; the Python-literal fallback then either fails (NUL) or
        # rewrites the text ("true" in a string became "True").
        ('{"thought": "a\x00b", "ok": true}', {"thought": "a\x00b", "ok": True}),
        ('Sure: {"thought": "is it true?\t", "ok": false} done', {"thought": "is it true?\t", "ok": False}),
        ("[1, 2]", None),
        ("no object", None),
        ('{"unterminated": ', None),
    ],
)
def test_extract_json_object(text: str, expected: object) -> None:
    assert extract_json_object(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": ' + "9" * 5000 + "}", None),  # over the 4,300-digit limit: json.loads raises a plain ValueError
        ('{"a": ' + "9" * 5000 + '} then {"b": 1}', {"b": 1}),
        ("{[1]: 2}", None),  # a Python literal that cannot be built (unhashable key): TypeError
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, None),  # nested deeper than either reader goes
        ('{"a": ' * 50_000 + '1 and then {"b": 2}', None),  # the scans' budget is spent before "b"
    ],
)
def test_extract_json_object_never_raises(text: str, expected: object) -> None:
    assert extract_json_object(text) == expected


def test_extract_json_object_scans_a_bounded_amount() -> None:
    """Thousands of unbalanced braces: each brace scan would read to the end (quadratic); the total is bounded."""
    from gyms import reply_json

    text = "{" * 20_000 + ' {"late": 1}'
    budget = [reply_json.SCAN_BUDGET * (len(text) + 1)]
    start = budget[0]
    assert reply_json._matching_brace(text, 0, budget) is None
    assert start - budget[0] == len(text)  # one scan to the end is charged what it read
    assert extract_json_object(text) is None  # given up after SCAN_BUDGET full scans
    assert extract_json_object("{" * 10 + ' {"early": 1}') == {"early": 1}


def test_strip_think() -> None:
    assert strip_think("<think>\nhmm\n</think>\n\nYes") == "Yes"
    assert strip_think("<THINK>a</THINK>b<think>c</think>d") == "bd"


@pytest.mark.parametrize("backend", ["aiohttp", "httpx"])
def test_both_http_backends(server: OpenAIServer, backend: str) -> None:
    server.rules = [fail_first(1, Fault(502), then=reply('{"ok": true}'))]
    sim = make_sim(server, http_backend=backend)
    assert chat(sim, json=True).data == {"ok": True}
    assert sim.metrics()["retries"] == 1.0


def test_aiohttp_backend_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from userrl_megatron.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "httpx_aiohttp" else real(name))
    with pytest.raises(UserError, match=r"user_sim\.http_backend=aiohttp needs the httpx-aiohttp package"):
        UserSimulator(UserSimConfig(api_key_env="none"))
    UserSimulator(UserSimConfig(api_key_env="none", http_backend="httpx"))  # the other transport needs nothing more


class HugeReplyServer:
    """Answers every chat call with a 200 MB completion, sent in 64 KiB writes until the client stops reading;
    `sent` counts what left the server."""

    SIZE = 200 * 2**20

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.sent = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)  # the request (small)
            head = b'{"choices": [{"message": {"role": "assistant", "content": "'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {self.SIZE}\r\n\r\n".encode()
                + head
            )
            chunk = b"x" * 65536
            try:
                while self.sent < self.SIZE:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
            except OSError:
                pass


@pytest.mark.parametrize("backend", ["aiohttp", "httpx"])
def test_an_oversized_reply_is_not_downloaded(backend: str) -> None:
    """A 200 MB reply to a simulator limited to 1,000 characters fails as too long once the client has read past
    what such a reply can take (12 x the characters + 64 KiB of envelope): the server gets to send little more
    than the sockets' buffers. At dafaaeb the client downloaded all of it before measuring the text."""
    huge = HugeReplyServer()
    cfg = UserSimConfig(base_url=huge.base_url, model="sim", timeout_s=SIM_TIMEOUT_S, max_retries=0)
    cfg.api_key_env, cfg.max_reply_chars, cfg.http_backend = "none", 1000, backend
    with pytest.raises(UserSimError) as e:
        chat(UserSimulator(cfg))
    assert e.value.kind == "too_long", e.value
    assert str(e.value).startswith(f"user simulator reply is over {reply_bytes_cap(1000)} bytes")
    assert huge.sent < 32 * 2**20
