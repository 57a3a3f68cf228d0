"""The user simulator: an async client of an OpenAI-compatible chat endpoint, shared by all gyms of a process.

One UserSimulator serves every episode: calls are bounded by a semaphore, each has a timeout, and timeouts,
connection errors, 408/409/429/5xx, empty replies and (for `json=True`) replies without a JSON object are retried
with exponential backoff and jitter; a reply longer than `max_reply_chars` fails at once (kind "too_long"), and
its body is read only up to what such a reply can take (`reply_bytes_cap`), never downloaded whole. A call
that still fails raises UserSimError; gyms then answer with their fallback feedback and mark
`StepResult.user_sim_error`, so nothing is silently scored. A call that could not reach the endpoint waits, before
its retry, for `reconnect` when whoever runs the endpoint set it (the run's own simulator engines: until the pool
has restarted a dead one, however long that takes) instead of a backoff. An optional on-disk cache
keyed by the request makes replays deterministic and debugging cheap. The API key comes from the environment
variable the config names, never from the config itself.

A call given its reply's schema (`gyms/reply_schema.py`) asks for it as `response_format: json_schema`
(constrained decoding) as `user_sim.structured` says: `on` always, `off` never, `auto` until the endpoint first
refuses it (HTTP 400/422 to a request that the same request without it gets answered): from then on the run asks
for free text, with one warning and the metric `structured_fallback`. The reply is parsed the same way either way.
"""

import asyncio
import collections
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyms.reply_json import extract_json_object, strip_think

if TYPE_CHECKING:
    from gyms.reply_schema import ReplySchema
    from userrl_megatron.config.gyms import UserSimConfig

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 429})  # plus every 5xx
LATENCY_WINDOW = 10_000  # answered calls the latency percentiles look back over
FORMAT_REFUSALS = frozenset({400, 422})  # how an endpoint refuses a request field it does not support


class Omit:
    """A request parameter left out of the request (the endpoint's own default applies), e.g. `temperature=OMIT`."""

    def __repr__(self) -> str:
        return "OMIT"


OMIT = Omit()


class UserSimError(RuntimeError):
    """A simulator call that failed for good (after its retries, or at once for a non-retryable error)."""

    def __init__(self, message: str, kind: str, attempts: int) -> None:
        super().__init__(message)
        # timeout | connection | rate_limit | server | bad_response | client | empty | bad_json | too_long
        self.kind = kind
        self.attempts = attempts


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Reply:
    """One simulator reply: the text (thinking removed), the parsed JSON object when asked for, metrics."""

    text: str
    data: dict[str, Any] | None = None
    usage: Usage = field(default_factory=Usage)
    latency_s: float = 0.0
    cached: bool = False


NO_AUTH = "none"  # `api_key_env: none`: the endpoint needs no key


def configured_key(cfg: "UserSimConfig") -> str:
    """The key in the environment variable `cfg.api_key_env` names; a UserError when it is unset or empty."""
    if cfg.api_key_env.lower() == NO_AUTH:
        return "EMPTY"  # the OpenAI client insists on some key; servers without auth ignore it
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        from userrl_megatron.errors import UserError

        raise UserError(
            f"user_sim.api_key_env names ${cfg.api_key_env}, which is not set: export it, or set "
            f"user_sim.api_key_env={NO_AUTH} for a server without authentication ({cfg.base_url})"
        )
    return key


class _FormatRefusedError(Exception):
    """The endpoint refused a request that asked for a structured reply (`user_sim.structured: auto`)."""


class _RetryableError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UserSimulator:
    """`await sim.chat(messages, json=True)` -> Reply; see the module docstring for the failure contract."""

    def __init__(self, cfg: "UserSimConfig", api_key: str | None = None) -> None:
        if cfg.http_backend == "aiohttp" and importlib.util.find_spec("httpx_aiohttp") is None:
            from userrl_megatron.errors import UserError

            raise UserError(
                "user_sim.http_backend=aiohttp needs the httpx-aiohttp package (requirements/runtime.txt); "
                "install it or set user_sim.http_backend=httpx"
            )
        self.cfg = cfg
        # A missing key is a start-up error, not a run of 401s; engines the run starts hand theirs over directly.
        self._api_key = api_key if api_key is not None else configured_key(cfg)
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary()
        )
        self._cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None
        # `unusable`: answered, but the caller could not use the reply (`unusable_reply`)
        counters = (
            "calls",
            "answered",
            "failures",
            "retries",
            "requests",
            "cache_hits",
            "structured_fallback",
            "unusable",
        )
        self._counts = dict.fromkeys((*counters, "prompt_tokens", "completion_tokens"), 0)
        self._latency_total = 0.0
        self._latency_max = 0.0
        # The latencies of the last LATENCY_WINDOW answered calls since the last reset (for the percentiles).
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._in_flight = 0
        self._in_flight_max = 0
        # Whether calls with a reply schema ask for it (`structured`: on, or auto until the endpoint refuses it).
        self.structured = cfg.structured_mode != "off"
        # Set by whoever runs the endpoint: returns once it can be reached again (e.g. its engine restarted), raises
        # when it will not be; awaited before the retry of a call that could not reach it, instead of the backoff.
        self.reconnect: Callable[[], Awaitable[None]] | None = None

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        temperature: float | Omit | None = None,
        max_tokens: int | Omit | None = None,
        json: bool = False,
        schema: "ReplySchema | None" = None,
    ) -> Reply:
        """One chat completion; with `json=True` the reply must contain a JSON object (`Reply.data`).

        `temperature` / `max_tokens`: None uses the config's value, `OMIT` leaves the parameter out of the request.
        `schema`: the reply's JSON schema, asked for as `response_format` while `self.structured` (it is not part
        of the cache key: a cached reply parses the same either way).
        """
        self._counts["calls"] += 1
        request: dict[str, Any] = {"model": self.cfg.model, "messages": _sendable(messages)}
        for key, value, default in (
            ("temperature", temperature, self.cfg.temperature),
            ("max_tokens", max_tokens, self.cfg.max_tokens),
        ):
            if value is not OMIT:
                request[key] = default if value is None else value
        key = _cache_key(request)
        cached = self._cache_read(key, json)
        if cached is not None:
            self._counts["cache_hits"] += 1
            return cached
        start = time.perf_counter()
        attempt = 0
        response_format = None
        if schema is not None and self.structured:
            response_format = schema.response_format(self.cfg.structured_text_chars)
        refusal = ""
        while True:
            attempt += 1
            try:
                reply = await self._attempt(request, json, response_format)
                break
            except _FormatRefusedError as e:  # the same request again, without it (not counted as a retry)
                response_format, refusal = None, str(e)
                attempt -= 1
            except _RetryableError as e:
                if attempt > self.cfg.max_retries:
                    self._count("failures", e.kind)
                    raise UserSimError(f"user simulator failed after {attempt} attempts: {e}", e.kind, attempt) from e
                if e.kind == "connection" and self.reconnect is not None:
                    try:
                        await self.reconnect()  # the endpoint's restart takes what it takes: no backoff outlasts it
                    except Exception as down:
                        self._count("failures", e.kind)
                        message = f"user simulator failed after {attempt} attempts: {e}; it is not coming back: {down}"
                        raise UserSimError(message, e.kind, attempt) from down
                    self._count("retries", e.kind)
                else:
                    self._count("retries", e.kind)
                    await asyncio.sleep(self._backoff(attempt))
            except UserSimError as e:
                self._count("failures", e.kind)
                raise
        if refusal:  # answered without the format the endpoint refused: it does not support it
            self._fall_back(refusal)
        reply.latency_s = time.perf_counter() - start
        self._counts["answered"] += 1
        self._latency_total += reply.latency_s
        self._latency_max = max(self._latency_max, reply.latency_s)
        self._latencies.append(reply.latency_s)
        self._cache_write(key, reply)
        return reply

    def _fall_back(self, refusal: str) -> None:
        """Ask for free text from now on (`structured: auto`, the endpoint refused response_format); once."""
        if not self.structured:
            return  # a call that was in flight when another one fell back
        self.structured = False
        self._counts["structured_fallback"] += 1
        log.warning(
            "user simulator at %s refuses response_format json_schema (%s): its replies are free text from now on "
            "(set user_sim.structured=off to skip asking, or serve it with SGLang or another engine that supports it)",
            self.cfg.base_url,
            refusal[:300],
        )

    def unusable_reply(self) -> None:
        """Count a reply that came back but that its caller could not use (a gym's needed key missing, as when a
        cut reply's inner object is all that parses): `unusable` in the metrics, apart from `failures`."""
        self._counts["unusable"] += 1

    def _count(self, what: str, kind: str) -> None:
        """One failure or retry, also counted by its kind (`failures/connection`, `retries/bad_json`, ...)."""
        self._counts[what] += 1
        self._counts[f"{what}/{kind}"] = self._counts.get(f"{what}/{kind}", 0) + 1

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Counters since construction (or the last reset): calls, failures and retries (also by kind), latency
        (mean, max, and p50 / p99 over the last `LATENCY_WINDOW` answered calls), cache hit rate, tokens, the
        fallback to free text (`structured_fallback`); and whether replies are asked for structured (`structured`)."""
        out = {k: float(v) for k, v in self._counts.items()}
        out["structured"] = float(self.structured)
        answered = self._counts["answered"]  # by the endpoint (cache hits excluded)
        out["latency_mean_s"] = self._latency_total / answered if answered else 0.0
        out["latency_max_s"] = self._latency_max
        out["latency_p50_s"] = _percentile(self._latencies, 0.50)
        out["latency_p99_s"] = _percentile(self._latencies, 0.99)
        out["cache_hit_rate"] = self._counts["cache_hits"] / self._counts["calls"] if self._counts["calls"] else 0.0
        out["in_flight_max"] = float(self._in_flight_max)
        if reset:
            self._counts = dict.fromkeys(self._counts, 0)
            self._latency_total = self._latency_max = 0.0
            self._latencies.clear()
            self._in_flight_max = self._in_flight
        return out

    async def close(self) -> None:
        """Close the HTTP client of the running event loop."""
        loop = asyncio.get_running_loop()
        state = self._per_loop.pop(loop, None)
        if state is not None:
            await state[0].close()

    async def _attempt(
        self, request: dict[str, Any], want_json: bool, response_format: dict[str, Any] | None = None
    ) -> Reply:
        import httpx
        import openai

        client, semaphore = self._loop_state()
        body = dict(request)
        if response_format is not None:
            body["response_format"] = response_format
        if self.cfg.disable_thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        async with semaphore:
            self._counts["requests"] += 1
            self._in_flight += 1
            self._in_flight_max = max(self._in_flight_max, self._in_flight)
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    # The client's low-level request: the typed-params transform and the response model of
                    # `chat.completions.create` cost about 0.6 ms of CPU per call, which adds up at this volume.
                    response = await client.post(
                        "/chat/completions", body=body, cast_to=httpx.Response, options={"headers": STREAM_BODY}
                    )
                    payload = json.loads(await self._read_capped(response))
            except (TimeoutError, openai.APIConnectionError) as e:  # APITimeoutError is an APIConnectionError
                if _refused(e):
                    raise _RetryableError("connection", f"cannot reach {self.cfg.base_url}: {e}") from e
                raise _RetryableError("timeout", f"no reply within {self.cfg.timeout_s} s") from e
            except openai.APIStatusError as e:
                status = e.status_code
                if status in RETRY_STATUS or status >= 500:
                    raise _RetryableError("rate_limit" if status == 429 else "server", f"HTTP {status}") from e
                refused = response_format is not None and status in FORMAT_REFUSALS
                if refused and self.cfg.structured_mode == "auto":
                    raise _FormatRefusedError(f"HTTP {status}: {e}") from e
                hint = f" (is ${self.cfg.api_key_env} set?)" if status in (401, 403) else ""
                if refused:
                    hint = " (user_sim.structured=on: does the endpoint support response_format json_schema?)"
                raise UserSimError(f"user simulator request rejected: HTTP {status}{hint}: {e}", "client", 1) from e
            except httpx.HTTPError as e:  # the body broke off while `_read_capped` read it
                raise _RetryableError("connection", f"reply cut off: {e}") from e
            except (openai.APIError, ValueError) as e:  # a 200 whose body is not JSON
                raise _RetryableError("bad_response", f"unreadable response: {e}") from e
            finally:
                self._in_flight -= 1
        return self._read(payload, want_json)

    async def _read_capped(self, response: Any) -> bytes:
        """The body of `response`, read until it ends or passes `reply_bytes_cap` bytes (then the call fails at
        once, "too_long", and the rest is never downloaded)."""
        cap = reply_bytes_cap(self.cfg.max_reply_chars)
        chunks, size = [], 0
        try:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > cap:
                    raise UserSimError(
                        f"user simulator reply is over {cap} bytes, more than user_sim.max_reply_chars "
                        f"({self.cfg.max_reply_chars}) allows: not read further",
                        "too_long",
                        1,
                    )
                chunks.append(chunk)
        finally:
            await response.aclose()
        return b"".join(chunks)

    def _read(self, payload: Any, want_json: bool) -> Reply:
        try:
            raw = payload["choices"][0]["message"]["content"] or ""
            usage_data = payload.get("usage") or {}
            usage = Usage(int(usage_data.get("prompt_tokens") or 0), int(usage_data.get("completion_tokens") or 0))
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise _RetryableError("bad_response", f"not a chat completion: {str(payload)[:200]}") from e
        self._counts["prompt_tokens"] += usage.prompt_tokens
        self._counts["completion_tokens"] += usage.completion_tokens
        if len(str(raw)) > self.cfg.max_reply_chars:
            raise UserSimError(
                f"user simulator reply of {len(str(raw))} characters is longer than user_sim.max_reply_chars "
                f"({self.cfg.max_reply_chars})",
                "too_long",
                1,
            )
        text = strip_think(str(raw))
        if not text:
            raise _RetryableError("empty", "empty reply")
        data = None
        if want_json:
            data = extract_json_object(text)
            if data is None:
                raise _RetryableError("bad_json", f"no JSON object in reply: {text[:200]!r}")
        return Reply(text=text, data=data, usage=usage)

    async def retarget(self, base_url: str) -> None:
        """Send the next calls to `base_url` (a restarted simulator engine's new address): the running loop's
        client is closed (calls in flight on it fail and are retried at the new address) and made again."""
        self.cfg = dataclasses.replace(self.cfg, base_url=base_url)
        await self.close()

    def _loop_state(self) -> tuple[Any, asyncio.Semaphore]:
        """The client and semaphore of the running loop (both are bound to the loop that first uses them)."""
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None:
            import openai

            http_client = _aiohttp_client() if self.cfg.http_backend == "aiohttp" else None
            client = openai.AsyncOpenAI(
                base_url=self.cfg.base_url,
                api_key=self._api_key,
                timeout=self.cfg.timeout_s,
                max_retries=0,  # retries are ours: counted, with jitter, and also for bad replies
                http_client=http_client,
            )
            state = (client, asyncio.Semaphore(self.cfg.max_concurrency))
            self._per_loop[loop] = state
        return state

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter in [0.5, 1.5) x base, capped."""
        base = min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.backoff_max_s)
        return base * (0.5 + random.random())

    def _cache_read(self, key: str, want_json: bool) -> Reply | None:
        if self._cache_dir is None:
            return None
        path = self._cache_dir / key[:2] / f"{key}.json"
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        text = stored.get("text", "")
        data = extract_json_object(text) if want_json else None
        if not text or (want_json and data is None):
            return None
        return Reply(text=text, data=data, usage=Usage(**stored.get("usage", {})), cached=True)

    def _cache_write(self, key: str, reply: Reply) -> None:
        if self._cache_dir is None:
            return
        path = self._cache_dir / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{random.randrange(1 << 30)}.tmp")
        usage = {"prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens}
        tmp.write_text(json.dumps({"text": reply.text, "usage": usage}))
        os.replace(tmp, path)  # atomic: concurrent writers of one key leave one whole file


# openai's header for a raw response whose body is left unread: `_read_capped` reads it, up to its cap.
STREAM_BODY = {"X-Stainless-Raw-Response": "stream"}
REPLY_ENVELOPE_BYTES = 65536  # a chat completion's JSON around its text (ids, usage, finish reason)


def reply_bytes_cap(max_reply_chars: int) -> int:
    """The largest reply body read: the text and as long a `reasoning_content`, each character escaped as six
    bytes (`\\uXXXX`) at worst, and the envelope."""
    return 2 * 6 * max_reply_chars + REPLY_ENVELOPE_BYTES


# Transport errors of an endpoint that cannot be reached or went away mid-request (httpx's, aiohttp's).
UNREACHED = ("ConnectError", "ClientConnectorError", "ServerDisconnectedError")


def _refused(error: BaseException) -> bool:
    """Whether a connection error was a failure to connect, or a connection the server closed without a reply
    (the aiohttp transport reports both as timeouts)."""
    cause = error.__cause__ or error.__context__
    while cause is not None:
        if isinstance(cause, ConnectionError) or type(cause).__name__ in UNREACHED:
            return True
        cause = cause.__cause__ or cause.__context__
    return type(error).__name__ == "APIConnectionError"  # not a timeout


def _aiohttp_client() -> Any:
    """openai's aiohttp transport: far less CPU per request than httpx's pool with hundreds of calls in flight."""
    import openai

    return openai.DefaultAioHttpClient()


def _sendable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with text UTF-8 cannot carry (lone surrogates, e.g. from a policy's `"\\ud800"` JSON escape)
    replaced by "?": such a request could be neither sent nor cached."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            try:
                content.encode("utf-8")
            except UnicodeEncodeError:
                message = {**message, "content": content.encode("utf-8", "replace").decode("utf-8")}
        out.append(message)
    return out


def _cache_key(request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
