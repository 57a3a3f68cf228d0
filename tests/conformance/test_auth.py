"""API keys, against both backends started with one (the embedded server with `--api-key-env`, real SGLang
0.5.23 with `--api-key` handed over by `fleet/key_entry.py`), as the rollout pool starts them: every route of
the embedded server answers 401 without the key or with a wrong one (SGLang checks before routing, so its
answer to the same paths is the same), health stays public, nothing changed the weights, the key opens every
route, and it shows neither in the process table nor in the server's log."""

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conformance.conftest import SGLANG_CPU, STARTUP_S
from tests.support.servers import http_call
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.fleet.router import launch_router
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON, launch_sglang
from userrl_megatron.model_store import resolve_model
from userrl_megatron.ports import free_port
from userrl_megatron.server.core import EngineCore
from userrl_megatron.server.http import build_app
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError

WATCHED = ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight")
UNAUTHORIZED = (401, {"error": "Unauthorized"})


@dataclass
class Keyed:
    backend: str
    server: ServerProcess
    key: str


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    """The keyed servers' model, one for both backends: the key is checked before any route is reached (SGLang's
    auth middleware, the embedded server's), whatever the model class, so another family would add start-ups and
    no check; SmolLM2's class reads its weights back by name on both backends, which `weights` needs."""
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf(smol_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[pytest.param("embedded"), pytest.param("sglang", marks=pytest.mark.slow)])
def keyed(request: pytest.FixtureRequest, smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    key = secrets.token_urlsafe(32)
    log = tmp_path_factory.mktemp("auth") / f"{request.param}.log"
    if request.param == "embedded":
        cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S)
        server = launch_embedded(str(smol_dir), cfg, free_port(), "float32", log_path=log, api_key=key)
    else:
        if not SGLANG_VENV_PYTHON.is_file():
            pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
        server = launch_sglang(
            SGLANG_CPU, str(smol_dir), 1, free_port(), "float32", log_path=log, device="cpu", api_key=key
        )
    yield Keyed(request.param, server, key)
    server.stop()


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """(method, path) of every route of the embedded server's application."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("routes") / "tiny", tokenizer="char")
    app = build_app(EngineCore(str(model), EmbeddedServerConfig(device="cpu")), api_key="k")
    found = {(r.method, r.resource.canonical.replace("{model}", "tiny")) for r in app.router.routes() if r.resource}
    return sorted(found)


def call(url: str, method: str, path: str, authorization: str | None, body: Any = None) -> tuple[int, Any]:
    """A raw call as a client without our library would make it: a JSON body (`{}` by default) except on GET."""
    data = None if method in ("GET", "HEAD") else ({} if body is None else body)
    return http_call(url, path, data, method, authorization)


def weights(server: ServerProcess, key: str) -> dict[str, Any]:
    """The first rows of the watched weights, read with the key."""
    body = {"truncate_size": 2}
    return {
        n: call(server.url, "POST", "/get_weights_by_name", f"Bearer {key}", body | {"name": n})[1] for n in WATCHED
    }


def test_every_route_needs_the_key(keyed: Keyed, routes: list[tuple[str, str]], hf: Any) -> None:
    url, key = keyed.server.url, keyed.key
    before = weights(keyed.server, key)
    assert all(torch.allclose(torch.tensor(before[n]), hf.get_parameter(n)[:2].float()) for n in WATCHED)
    # Bodies that would change the engine if they were let through.
    harmful = {
        "/pause_generation": {"mode": "abort"},
        "/begin_weight_update": {},
        "/update_weight_version": {"new_version": "hijacked"},
        "/release_memory_occupation": {"tags": ["kv_cache"]},
        "/update_weights_from_disk": {"model_path": "/"},
        "/init_weights_update_group": {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo",
        },
    }  # fmt: skip
    public = [(m, p) for m, p in routes if p.startswith(("/health", "/ready"))]
    assert sorted({p for _, p in public}) == ["/health", "/health_generate", "/ready"]
    wrong = [None, f"Bearer {key[:-1]}", f"Basic {key}", key, f"Bearer  {key}", "Bearer"]
    for method, path in routes:
        if (method, path) in public:
            continue
        expected = (401, "") if method == "HEAD" else UNAUTHORIZED  # a HEAD answer has no body
        for authorization in wrong:
            answer = call(url, method, path, authorization, harmful.get(path))
            assert answer == expected, (keyed.backend, method, path, authorization, answer)
    assert call(url, "GET", "/health_generate", None)[0] == 200
    # The server still serves, with the weights and version it had.
    assert weights(keyed.server, key) == before
    status, info = call(url, "GET", "/model_info", f"bearer {key}")  # the scheme is case-insensitive, as SGLang's
    assert status == 200 and info["weight_version"] == "default"
    assert call(url, "GET", "/ready", None)[0] == 200  # not paused
    assert call(url, "POST", "/flush_cache", f"Bearer {key}")[0] == 200  # nothing was left running or paused


def test_the_key_opens_generation_and_control(keyed: Keyed) -> None:
    async def go() -> tuple[int, str]:
        async with SGLangClient(keyed.server.url, api_key=keyed.key) as client:
            generation = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0))
            await client.pause("abort")
            await client.resume()
            await client.begin_weight_update()
            await client.end_weight_update()
            return len(generation.output_ids), (await client.get_model_info())["weight_version"]

    assert asyncio.run(go()) == (2, "default")

    async def unkeyed() -> None:
        async with SGLangClient(keyed.server.url, max_retries=0) as client:
            await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))

    with pytest.raises(EngineError, match=r"^/generate: Unauthorized \(HTTP 401\)$"):
        asyncio.run(unkeyed())


def test_the_key_is_neither_in_the_process_table_nor_in_the_log(keyed: Keyed) -> None:
    root = psutil.Process(keyed.server.process.pid)
    processes = [root, *root.children(recursive=True)]
    assert len(processes) >= (3 if keyed.backend == "sglang" else 1)  # SGLang: watchdog, server, scheduler
    for process in processes:
        assert keyed.key not in " ".join(process.cmdline()), process.cmdline()
    log = keyed.server.log_path.read_text(errors="replace")
    assert keyed.key not in log
    if keyed.backend == "sglang":  # SGLang logs its arguments, the key among them: key_entry.py filters it out
        assert "'api_key': '<redacted>'" in log, log[-3000:]


def raw_status(url: str, authorization: bytes) -> int:
    """The status of `GET /model_info` sent as raw bytes, `authorization` the Authorization header's value."""
    parts = urlsplit(url)
    head = b"GET /model_info HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization + b"\r\nConnection: close\r\n\r\n"
    answer = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=STARTUP_S) as sock:
        sock.sendall(head)
        while b"\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_malformed_authorization_headers_leave_no_key_in_the_log(keyed: Keyed) -> None:
    """Issue 57 N9, on both backends: the key followed by a NUL, and the key inside a header line over 8,190
    bytes. The embedded server (aiohttp) refuses all three with 400 and logs one line without their bytes.
    SGLang 0.5.23 serves HTTP with uvicorn's h11 protocol (no httptools in its venv): h11 refuses the NUL, and
    uvicorn logs only "Invalid HTTP request received." (uvicorn/protocols/http/h11_impl.py:182-184); the long
    headers parse (h11 takes up to 16 KiB) and SGLang's key check answers 401 without logging the header
    (sglang/srt/utils/auth.py:174-206). Neither log holds a part of the key, and no new `<redacted>` appears:
    the backend itself wrote no key (the filters of `server/log_redaction.py` and `fleet/key_entry.py` would
    have hidden a whole one)."""
    key = keyed.key.encode()
    log = keyed.server.log_path
    redacted_before = log.read_bytes().count(b"<redacted>")
    headers = [b"Bearer " + key + b"\x00", b"Bearer " + key + b"A" * 8200, b"Bearer " + b"A" * 8200 + key]
    statuses = [raw_status(keyed.server.url, header) for header in headers]
    expected_line = b"Invalid HTTP request received." if keyed.backend == "sglang" else b"malformed HTTP request"
    deadline = time.monotonic() + STARTUP_S  # the line reaches the file through the server's log pipeline
    while expected_line not in log.read_bytes():
        assert time.monotonic() < deadline, log.read_bytes()[-3000:]
        time.sleep(0.1)
    assert call(keyed.server.url, "GET", "/model_info", f"Bearer {keyed.key}")[0] == 200  # still serving
    text = log.read_bytes()
    assert statuses == ([400, 401, 401] if keyed.backend == "sglang" else [400, 400, 400])
    assert key[:20] not in text and key[-20:] not in text
    assert text.count(b"<redacted>") == redacted_before


ROUTER_PROBES = (
    "/v1/models", "/get_server_info", "/server_info", "/get_model_info", "/model_info", "/health", "/liveness",
    "/readiness", "/health_generate", "/metrics", "/get_load", "/engine_metrics", "/workers", "/flush_cache",
)  # fmt: skip
ROUTER_PUBLIC = {"/v1/models", "/get_server_info", "/health", "/liveness", "/readiness", "/health_generate"}


def test_the_router_answers_without_the_key_but_never_with_it(keyed: Keyed, tmp_path: Path) -> None:
    """sglang-router 0.3.2 in front of the keyed engine, started as the pool starts it: the routes it answers
    without the key (ROUTER_PUBLIC; no option of 0.3.2 covers them) are its own, and none returns the key. SGLang
    0.5.23's keyed `/server_info` holds the key among its arguments (`ServerArgs.resolved_dict`,
    sglang/srt/utils/common.py `build_server_info`): were the router to forward it, any local user could read it."""
    router = launch_router(
        SGLANG_CPU, [keyed.server.url], free_port(), free_port(), log_path=tmp_path / "router.log",
        timeout_s=STARTUP_S, api_key=keyed.key,
    )  # fmt: skip
    try:
        answers = {path: http_call(router.url, path, method="GET") for path in ROUTER_PROBES}
        _, engine_info = call(keyed.server.url, "GET", "/server_info", f"Bearer {keyed.key}")
    finally:
        router.stop()
    assert {path for path, (status, _) in answers.items() if status == 200} == ROUTER_PUBLIC
    assert all(keyed.key not in json.dumps(body) for _, body in answers.values())
    assert answers["/get_server_info"][1] == {"router_manager": True, "routers_count": 1, "workers_count": 1}
    if keyed.backend == "sglang":
        assert engine_info["api_key"] == keyed.key
