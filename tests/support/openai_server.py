"""A small OpenAI-compatible server for tests: scripted replies and injected faults over real HTTP.

    with OpenAIServer(when("Yes-or-No", "Yes"), fail_first(2, Fault(500), then=reply("ok"))) as server:
        sim = UserSimulator(UserSimConfig(base_url=server.base_url, ...))

It serves `POST /v1/chat/completions` and `GET /v1/models` on 127.0.0.1 (a free port) from a background thread,
so sync and async tests (and benchmarks) can use it alike. A rule is a callable from the request body (a dict)
to a reply: a string (the assistant content), an `Answer` (content with a delay / token counts), a `Fault`
(an HTTP error, a delay, or a dropped connection), or None to let the next rule decide. The server counts
requests (`server.count`, `server.requests`) and the most requests it had in flight at once (`max_in_flight`).

Nothing here depends on how fast the machine is: a timeout fault is a reply delayed by `FOREVER` (it never comes
while the server runs, so only the client's timeout ends the call), and `hold_until_in_flight = n` holds every
request until n have been in flight together, so a client's concurrency shows whatever the scheduling.
"""

import asyncio
import contextlib
import itertools
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FOREVER = math.inf  # a delay_s: no reply until the server stops
HOLD_LIMIT_S = 60.0  # `hold_until_in_flight` lets requests through after this long (a client that never gets there)
START_STOP_S = 60.0  # the server thread starts and stops in well under a second: only a hang takes this long


@dataclass
class Answer:
    content: str
    delay_s: float = 0.0  # wait before answering; FOREVER (a timeout fault): until the server stops
    prompt_tokens: int = 11
    completion_tokens: int = 7
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI `tool_calls` of the message (see `tool_call`)
    finish_reason: str = ""  # "" = "tool_calls" with tool calls, else "stop"


@dataclass
class Fault:
    status: int = 500  # HTTP status of the error reply
    body: str = '{"error": {"message": "injected fault", "type": "server_error"}}'
    delay_s: float = 0.0  # as Answer.delay_s
    drop: bool = False  # close the connection without any reply
    headers: dict[str, str] = field(default_factory=dict)


Reply = str | Answer | Fault
Rule = Callable[[dict[str, Any]], Reply | None]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def reply(content: Reply) -> Rule:
    """Always this reply."""
    return lambda body: content


def when(substring: str, content: Reply | Rule) -> Rule:
    """When any message contains `substring`: this reply, or what the rule `content` answers."""

    def rule(body: dict[str, Any]) -> Reply | None:
        if not any(substring in str(m.get("content", "")) for m in body["messages"]):
            return None
        return content(body) if callable(content) else content

    return rule


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_1", content: str = "") -> Answer:
    """A reply whose message calls one tool (arguments sent as a JSON string, as OpenAI does)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return Answer(content, tool_calls=[call])


def sequence(*contents: Reply) -> Rule:
    """Successive replies for successive requests (the last one repeats)."""
    counter = itertools.count()
    return lambda body: contents[min(next(counter), len(contents) - 1)]


def fail_first(n: int, fault: Fault | Reply, then: Rule) -> Rule:
    """`fault` for the first `n` requests that reach this rule, then defer to `then`."""
    counter = itertools.count()
    return lambda body: fault if next(counter) < n else then(body)


class OpenAIServer:
    """See the module docstring."""

    def __init__(self, *rules: Rule, model: str = "test-model", routes: dict[str, Handler] | None = None) -> None:
        self.rules = list(rules)
        self.routes = routes or {}  # extra routes, "METHOD /path" or "/path" (POST), e.g. a search API stub
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold_until_in_flight = 0  # > 0: hold each request until this many have been in flight together
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None  # set when the server stops: delayed replies go out
        self._gathered: asyncio.Event | None = None  # set once `hold_until_in_flight` requests were in flight
        self._ids = itertools.count(1)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def count(self) -> int:
        """Chat requests received so far."""
        return len(self.requests)

    def __enter__(self) -> "OpenAIServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="openai-test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=START_STOP_S):
            raise RuntimeError("test OpenAI server did not start")

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=START_STOP_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=START_STOP_S)
        self._loop = None

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._startup())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _startup(self) -> None:
        self._stopping, self._gathered = asyncio.Event(), asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        for route, handler in self.routes.items():
            method, path = route.split(" ", 1) if " " in route else ("POST", route)
            app.router.add_route(method, path, handler)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        assert self._stopping is not None and self._gathered is not None
        self._stopping.set()
        self._gathered.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_until_in_flight:
                assert self._gathered is not None
                if self.max_in_flight >= self.hold_until_in_flight:
                    self._gathered.set()
                await _wait(self._gathered, HOLD_LIMIT_S)
            return await self._answer(request, body)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = next((r for r in (rule(body) for rule in self.rules) if r is not None), None)
        if out is None:
            return web.json_response({"error": {"message": "no rule matched the request"}}, status=400)
        if isinstance(out, str):
            out = Answer(out)
        if out.delay_s:
            assert self._stopping is not None
            await _wait(self._stopping, out.delay_s)
        if isinstance(out, Fault):
            if out.drop:
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            return web.Response(status=out.status, text=out.body, headers=out.headers, content_type="application/json")
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.tool_calls:
            message["tool_calls"] = out.tool_calls
        finish = out.finish_reason or ("tool_calls" if out.tool_calls else "stop")
        payload = {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
            },
        }
        return web.Response(text=json.dumps(payload), content_type="application/json")


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` (FOREVER: no bound) has passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), None if math.isinf(timeout_s) else timeout_s)


def serve_in_process(content: str, delay_s: float, url_queue: Any, stop: Any) -> None:
    """Target of a child process (benchmarks): answer every call with `content` after `delay_s`, put the base URL
    on `url_queue`, and serve until the `stop` event is set."""
    with OpenAIServer(reply(Answer(content, delay_s=delay_s))) as server:
        url_queue.put(server.base_url)
        stop.wait()
