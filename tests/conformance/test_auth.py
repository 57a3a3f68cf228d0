"""API keys, against both backends started with one (the embedded server with `--api-key-env`, real SGLang
0.5.23 with `--api-key` handed over by `fleet/key_entry.py`), as the rollout pool starts them: every route of
the embedded server answers 401 without the key or with a wrong one (SGLang checks before routing, so its
answer to the same paths is the same), health stays public, nothing changed the weights, the key opens every
route, and it shows neither in the process table nor in the server's log."""

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
