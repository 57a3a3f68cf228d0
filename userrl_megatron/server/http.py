"""The aiohttp server: SGLang's native endpoints over an `EngineCore` (OpenAI routes live in `openai_api`).

Status codes and bodies follow SGLang 0.5.23: `{"success", "message"}` with 200/400 for weight and group control,
`{"error": {"message"}}` for handler errors, `{"error": "<text>"}` for contract violations, and the
`{"object": "error", "message", "type", "param", "code"}` shape for malformed bodies.
"""

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from userrl_megatron.server.bodies import BadRequestError, closing, parse_json, read_body
from userrl_megatron.server.connections import (
    ConnectionGuard,
    connection_cap,
    listen_backlog,
    rate_limited_exception_handler,
)
from userrl_megatron.server.core import EngineCore, call_soon
from userrl_megatron.server.log_redaction import redact_server_log
from userrl_megatron.server.protocol import (
    GenerateItem,
    check_logprob_fields,
    contract_error,
    generate_response,
    parse_generate,
    should_stream,
    stream_interval,
)
from userrl_megatron.server.sampling import parse_sampling_params
from userrl_megatron.server.scheduler import PAUSE_MODES, Request
from userrl_megatron.server.threads import DaemonPool
from userrl_megatron.wire.bearer import bearer_matches, is_public
from userrl_megatron.wire.handles import is_base64

log = logging.getLogger(__name__)

CORE_KEY = web.AppKey("core", EngineCore)
API_KEY = web.AppKey("api_key", str)  # "" = no key required
JSON_KEY = web.AppKey("json", DaemonPool)  # threads that parse bodies and encode replies
GUARD_KEY = web.AppKey("guard", ConnectionGuard)
JSON_THREADS = 2
SHUTDOWN_GRACE_S = 2.0  # how long a stopping server lets handlers finish (everything in flight was answered)
REQUIRED = object()
CONTROL_BODY_BYTES = 1 << 20  # bodies of the control calls (pause, groups, versions, memory, disk loads)
GENERATE_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")  # max_generate_request_bytes
PAYLOAD_ROUTES = ("/update_weights_from_tensor", "/update_weights_from_distributed")  # max_request_bytes
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def error_shape(message: str, status: int = 400, kind: str = "Bad Request") -> web.Response:
    """SGLang's `ErrorResponse` body (its RequestValidationError and HTTPException handlers)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def error_message(message: str, status: int = 400) -> web.Response:
    """SGLang's `_create_error_response`: {"error": {"message": ...}}."""
    return web.json_response({"error": {"message": message}}, status=status)


def success_message(ok: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


def body_limit(core: EngineCore, path: str) -> int:
    """The largest body `path` takes: generation routes and weight payloads their configured limits, control calls
    CONTROL_BODY_BYTES; never more than `max_request_bytes`."""
    cfg = core.cfg
    if path in GENERATE_ROUTES:
        return min(cfg.max_generate_request_bytes, cfg.max_request_bytes)
    if path in PAYLOAD_ROUTES:
        return cfg.max_request_bytes
    return min(CONTROL_BODY_BYTES, cfg.max_request_bytes)


async def read_json(request: web.Request, required: bool = True) -> Any:
    """The JSON body, within its route's limits (`bodies.py`), parsed off the event loop; an empty body is `{}`
    unless the endpoint needs one."""
    core = request.app[CORE_KEY]
    raw = await read_body(request, body_limit(core, request.path), core.cfg.body_timeout_s)
    if not raw or raw.isspace():
        if required:
            raise BadRequestError("1 validation error:\n  body: Field required")
        return {}
    return await parse_json(raw, request.app[JSON_KEY])


async def json_reply(request: web.Request, build: Callable[[], Any]) -> web.Response:
    """`build()`'s JSON as the response, built and encoded on a worker thread (a long reply never stalls the loop)."""
    body = await request.app[JSON_KEY].run(lambda: json.dumps(build()).encode())
    return web.Response(body=body, content_type="application/json", charset="utf-8")


def fields(body: Any, spec: dict[str, tuple[type | tuple[type, ...], Any]]) -> dict[str, Any]:
    """Pick typed fields from a control endpoint's body (pydantic-style checks, 400 on violation)."""
    if not isinstance(body, dict):
        raise BadRequestError("1 validation error:\n  body: Input should be a valid dictionary")
    out, problems = {}, []
    for name, (types, default) in spec.items():
        value = body.get(name, default)
        if value is REQUIRED:
            problems.append(f"  body.{name}: Field required")
        elif value is not None and not _is_instance(value, types):
            problems.append(f"  body.{name}: Input should be of type {_type_names(types)}, got {value!r}")
        out[name] = value
    if problems:
        raise BadRequestError(
            f"{len(problems)} validation error{'s' if len(problems) > 1 else ''}:\n" + "\n".join(problems)
        )
    return out


def _is_instance(value: Any, types: type | tuple[type, ...]) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types) or (float in types and isinstance(value, int))


def _type_names(types: type | tuple[type, ...]) -> str:
    return " | ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


@web.middleware
async def bad_request_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequestError as e:
        return error_shape(str(e))


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """SGLang's `--api-key` check, before routing and before the body is read: every path but health, readiness
    and metrics needs `Authorization: Bearer <key>`; else 401 `{"error": "Unauthorized"}`, as SGLang answers, and
    the connection is closed without reading the body. An authorised request's connection is never evicted by
    the connection cap (`connections.py`) while it runs."""
    key = request.app[API_KEY]
    public = is_public(request.method, request.path)
    if key and not public and not bearer_matches(request.headers.get("Authorization"), key):
        return closing(web.json_response({"error": "Unauthorized"}, status=401))
    if key and public:
        return await handler(request)
    done = request.app[GUARD_KEY].busy(request)
    try:
        return await handler(request)
    finally:
        done()


def build_app(core: EngineCore, api_key: str = "") -> web.Application:
    """The aiohttp application serving the native API and the OpenAI routes (requiring `api_key` if given)."""
    from userrl_megatron.server.openai_api import add_openai_routes

    app = web.Application(
        middlewares=[auth_middleware, bad_request_middleware], client_max_size=core.cfg.max_request_bytes
    )
    app[CORE_KEY] = core
    app[API_KEY] = api_key
    app[JSON_KEY] = DaemonPool(JSON_THREADS, "json")
    app[GUARD_KEY] = ConnectionGuard(connection_cap(core.cfg.max_connections))
    r = app.router
    for method in ("POST", "PUT"):
        r.add_route(method, "/generate", generate)
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    r.add_get("/ready", ready)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush_cache)
        r.add_route(method, "/get_weights_by_name", get_weights_by_name)
        r.add_route(method, "/release_memory_occupation", release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_get("/get_load", get_load)
    add_openai_routes(app)
    return app


# ---- generation ----


def make_request(core: EngineCore, item: GenerateItem) -> Request:
    """Validate one item's sampling and log-prob fields and its length; ValueError names the field."""
    spec = parse_sampling_params(item.sampling, core.model.spec.vocab_size)
    core.check_input(item.input_ids, spec.max_new_tokens)
    check_logprob_fields(item, core.model.spec.vocab_size, core.cfg.max_top_logprobs_num)
    if item.return_routed_experts and (problem := core.routing_problem()):
        raise ValueError(f"return_routed_experts: {problem}.")
    return Request(
        input_ids=item.input_ids,
        sampling=spec,
        rid=item.rid,
        return_logprob=item.return_logprob,
        logprob_start_len=item.logprob_start_len,
        top_logprobs_num=item.top_logprobs_num,
        return_routed_experts=item.return_routed_experts,
        routed_experts_start_len=item.routed_experts_start_len,
    )


async def generate(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    body = await read_json(request)
    problem = contract_error(body)
    if problem is not None:
        return web.json_response({"error": problem}, status=400)
    try:
        if body.get("text") is not None:  # tokenising a long text must not stall the loop
            items, single = await core.tokenize(lambda: parse_generate(body, core.model, core.cfg.max_prompt_chars))
        else:
            items, single = parse_generate(body, core.model)
        requests = [make_request(core, item) for item in items]
        if body.get("stream") and not single:
            raise ValueError("Streaming a batch or n > 1 is not supported by the embedded server.")
        await core.attach_grammars(requests)
    except ValueError as e:
        return error_message(str(e))
    if body.get("stream"):
        return await _stream(request, core, requests[0], items[0])
    done = await asyncio.gather(*(core.generate(r) for r in requests))

    def build() -> Any:
        objects = [generate_response(r, item, core.model) for r, item in zip(done, items, strict=True)]
        return objects[0] if single else objects

    return await json_reply(request, build)


async def _stream(http: web.Request, core: EngineCore, request: Request, item: GenerateItem) -> web.StreamResponse:
    """Server-sent events of cumulative objects, then `data: [DONE]`: one per token, or with `stream_interval` N
    the first token at once and then one per N tokens (SGLang's rule, `should_stream`); the final object always."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    interval, sent = stream_interval(item.sampling), 0

    def on_token(r: Request) -> None:  # on the scheduler thread
        nonlocal sent
        if should_stream(sent, len(r.output_ids), interval):
            sent = len(r.output_ids)
            call_soon(loop, queue.put_nowait, _snapshot(r))

    request.on_token = on_token
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    task = asyncio.ensure_future(core.generate(request))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    encode = http.app[JSON_KEY].run  # chunks are built and encoded off the loop

    def event(r: Request, final: bool) -> bytes:
        return b"data: " + json.dumps(generate_response(r, item, core.model, final=final)).encode() + b"\n\n"

    try:
        while (partial := await queue.get()) is not None:
            await response.write(await encode(lambda p=partial: event(p, False)))  # type: ignore[misc]
        await response.write(await encode(lambda: event(task.result(), True)))
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        core.abort_request(request.rid)
        raise
    return response


def _snapshot(request: Request) -> Request:
    """A copy whose lists the scheduler thread will not append to."""
    snap = copy.copy(request)
    snap.output_ids, snap.output_logprobs = list(request.output_ids), list(request.output_logprobs)
    snap.output_top_logprobs = list(request.output_top_logprobs)
    return snap


async def abort_request(request: web.Request) -> web.Response:
    body = fields(await read_json(request, required=False), {"rid": (str, ""), "abort_all": (bool, False)})
    request.app[CORE_KEY].abort_request(body["rid"], body["abort_all"])
    return web.Response(status=200)


# ---- health and introspection ----


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if await request.app[CORE_KEY].health() else 503)


async def ready(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    return web.Response(status=200 if core.started and not core.scheduler.paused else 503)


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[CORE_KEY].model_info())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[CORE_KEY].server_info())


# ---- cache, pause ----


async def flush_cache(request: web.Request) -> web.Response:
    try:
        timeout = float(request.query.get("timeout", 0.0))
        if timeout < 0:
            raise ValueError
    except ValueError:
        raise BadRequestError(
            f"1 validation error:\n  query.timeout: Input should be greater than or equal to 0, got "
            f"{request.query.get('timeout')!r}"
        ) from None
    ok, message = await request.app[CORE_KEY].flush_cache(timeout)
    return web.Response(text=FLUSH_OK if ok else (message or "Flush cache failed.\n"), status=200 if ok else 400)


async def pause_generation(request: web.Request) -> web.Response:
    body = fields(await read_json(request), {"mode": (str, "abort")})
    if body["mode"] not in PAUSE_MODES:
        raise BadRequestError(
            f"1 validation error:\n  body.mode: Input should be 'abort', 'retract' or 'in_place', got {body['mode']!r}"
        )
    await request.app[CORE_KEY].pause_generation(body["mode"])
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    fields(await read_json(request), {"torch_empty_cache": (bool, True)})
    await request.app[CORE_KEY].continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


# ---- weight sync ----


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = fields(
        await read_json(request),
        {
            "master_address": (str, REQUIRED),
            "master_port": (int, REQUIRED),
            "rank_offset": (int, REQUIRED),
            "world_size": (int, REQUIRED),
            "group_name": (str, "weight_update_group"),
            "backend": (str, "nccl"),
        },
    )
    return success_message(*await request.app[CORE_KEY].init_weights_update_group(**body))


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = fields(await read_json(request), {"group_name": (str, "weight_update_group")})
    return success_message(*await request.app[CORE_KEY].destroy_weights_update_group(body["group_name"]))


async def begin_weight_update(request: web.Request) -> web.Response:
    body = fields(await read_json(request), {"selector": (str, "all")})
    return success_message(*await request.app[CORE_KEY].begin_weight_update(body["selector"]))


async def end_weight_update(request: web.Request) -> web.Response:
    await read_json(request)
    return success_message(*await request.app[CORE_KEY].end_weight_update())


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = fields(
        await read_json(request),
        {
            "names": (list, REQUIRED),
            "dtypes": (list, REQUIRED),
            "shapes": (list, REQUIRED),
            "group_name": (str, "weight_update_group"),
            "flush_cache": (bool, True),
            "abort_all_requests": (bool, False),
            "weight_version": (str, None),
            "load_format": (str, None),
            "selector": (str, "all"),
            "torch_empty_cache": (bool, False),
        },
    )
    body.pop("selector"), body.pop("torch_empty_cache")
    return success_message(*await request.app[CORE_KEY].update_weights_from_distributed(**body))


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's colocated path: one payload per engine TP rank (`wire/handles.py`); the embedded engine is TP
    rank 0 and reads entry 0. Payloads must be base64 strings (SGLang's request validation)."""
    body = fields(
        await read_json(request),
        {
            "serialized_named_tensors": (list, REQUIRED),
            "load_format": (str, None),
            "flush_cache": (bool, True),
            "abort_all_requests": (bool, False),
            "weight_version": (str, None),
            "selector": (str, "all"),
            "torch_empty_cache": (bool, False),
        },
    )
    payloads = body["serialized_named_tensors"]
    if not all(isinstance(p, str) and is_base64(p) for p in payloads):
        raise BadRequestError("1 validation error:\n  body.serialized_named_tensors: Expected base64-encoded bytes")
    core = request.app[CORE_KEY]
    return success_message(
        *await core.update_weights_from_tensor(
            payloads, body["load_format"], body["flush_cache"], body["abort_all_requests"], body["weight_version"]
        )
    )


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = fields(
        await read_json(request),
        {
            "model_path": (str, REQUIRED),
            "load_format": (str, None),
            "abort_all_requests": (bool, False),
            "weight_version": (str, None),
            "flush_cache": (bool, True),
            "is_async": (bool, False),
            "torch_empty_cache": (bool, False),
            "keep_pause": (bool, False),
            "recapture_cuda_graph": (bool, False),
            "token_step": (int, 0),
            "manifest": (dict, None),
            "allow_partial": (bool, False),
        },
    )
    core = request.app[CORE_KEY]
    ok, message = await core.update_weights_from_disk(
        body["model_path"], body["flush_cache"], body["abort_all_requests"], body["weight_version"],
        body["allow_partial"],
    )  # fmt: skip
    return success_message(ok, message, num_paused_requests=0)


async def get_load(request: web.Request) -> web.Response:
    return web.json_response(request.app[CORE_KEY].load())


async def update_weight_version(request: web.Request) -> web.Response:
    body = fields(await read_json(request), {"new_version": (str, REQUIRED), "abort_all_requests": (bool, True)})
    try:
        await request.app[CORE_KEY].update_weight_version(body["new_version"], body["abort_all_requests"])
    except Exception as e:
        return success_message(False, f"Failed to update weight version: {e}")
    version = body["new_version"]
    return success_message(True, f"Weight version updated to {version}", new_version=version)


async def get_weights_by_name(request: web.Request) -> web.Response:
    body = fields(await read_json(request), {"name": (str, REQUIRED), "truncate_size": (int, 100)})
    try:
        values = await request.app[CORE_KEY].get_weights_by_name(body["name"], body["truncate_size"])
    except ValueError as e:
        return error_message(f"Get parameter by name failed: {e}")
    if values is None:
        return error_message("Get parameter by name failed")
    return web.json_response(values)


# ---- memory ----


async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, request.app[CORE_KEY].release_memory_occupation)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, request.app[CORE_KEY].resume_memory_occupation)


async def _memory(request: web.Request, operation: Callable) -> web.Response:
    body = fields(await read_json(request), {"tags": (list, None)})
    try:
        await operation(body["tags"])
    except Exception as e:
        return error_message(str(e))
    return web.json_response(None)


# ---- running ----


class _Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 connection preface: sglang-router probes every worker with gRPC
    before HTTP/1.1, and the refused probe is expected, not an error of the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


HTTP2_PROBE_FILTER = _Http2ProbeFilter()  # one instance: adding it again is a no-op


async def serve(core: EngineCore, host: str, port: int, stop: asyncio.Event, api_key: str = "") -> None:
    """Serve until `stop` is set (the caller owns the core's lifetime), requiring `api_key` if given.

    A connection without complete request headers for `idle_timeout_s` is closed (aiohttp's keep-alive timeout
    runs from the connection's start), a refused or oversized request's body is not drained (no lingering),
    connections are capped (`connections.py`), and the log holds neither the key nor a malformed request's bytes
    (`log_redaction.py`)."""
    # A client that disconnects cancels its handler, which aborts its requests (as SGLang does).
    app = build_app(core, api_key)
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        keepalive_timeout=core.cfg.idle_timeout_s,
        lingering_time=0,
    )
    logging.getLogger("aiohttp.server").addFilter(HTTP2_PROBE_FILTER)
    redact_server_log(api_key)
    rate_limited_exception_handler(asyncio.get_running_loop())
    await runner.setup()
    assert runner.server is not None
    app[GUARD_KEY].attach(runner.server)
    site = web.TCPSite(runner, host, port, backlog=listen_backlog())
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port  # the port the system picked for port 0
    log.info(
        "serving %s on http://%s:%d (at most %d connections)", core.served_model_name, host, bound, app[GUARD_KEY].cap
    )
    try:
        await stop.wait()
    finally:
        core.begin_shutdown()  # requests end as aborted, a pending group join fails: handlers return at once
        await runner.cleanup()
        await core.end_joins()
