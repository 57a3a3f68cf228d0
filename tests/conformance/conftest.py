"""One engine per backend for the tests of this folder: the embedded server and the real SGLang 0.5.23 server
(from .venv-sglang, `make sglang`), both serving SmolLM2-135M-Instruct in float32 on CPU through the launch path
the rollout pool uses. Every test here runs against both. SGLang start-up costs 30-100 s on 2 cores, so each
server lives for the whole folder (package scope: it is stopped before the tests of other folders run, which
need the memory), and every test leaves it with the original weights and nothing released."""

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.servers import push_weights
from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON, launch_sglang
from userrl_megatron.model_store import resolve_model
from userrl_megatron.ports import free_port

# Start-up took 60-110 s on 2 cores at load 12-16 (docs/benchmarks.md): the bound is for a hung server only.
STARTUP_S = 1200.0
SGLANG_CPU = SGLangConfig(max_total_tokens=16384, startup_timeout_s=STARTUP_S)
CHANGED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def read_back(url: str, names: list[str], rows: int = 2) -> dict[str, torch.Tensor]:
    """The first `rows` rows of each named weight, as the engine holds it."""
    async with SGLangClient(url) as client:
        return {n: torch.tensor(await client.get_weights_by_name(n, truncate_size=rows)) for n in names}


@dataclass
class Engine:
    """A running engine under test."""

    backend: str  # "embedded" or "sglang"
    server: ServerProcess
    logprob_tol: float  # largest difference to transformers' log-probs (SGLang's CPU kernels differ slightly)

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="package")
def smol_dir() -> Path:
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="package")
def hf(smol_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(
    scope="package",
    params=[pytest.param("embedded"), pytest.param("sglang", marks=pytest.mark.slow)],
)
def engine(
    request: pytest.FixtureRequest, smol_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("conformance") / f"{request.param}.log"
    if request.param == "embedded":
        cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S)
        server = launch_embedded(str(smol_dir), cfg, free_port(), "float32", log_path=log)
        tolerance = 1e-4
    else:
        if not SGLANG_VENV_PYTHON.is_file():
            pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
        server = launch_sglang(SGLANG_CPU, str(smol_dir), 1, free_port(), "float32", log_path=log, device="cpu")
        tolerance = 2e-3
    yield Engine(request.param, server, tolerance)
    alive = server.alive()
    server.stop()
    assert alive, f"the {request.param} server died during the suite:\n{server.log_tail(60)}"


@pytest.fixture
def originals(engine: Engine, hf: Any) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors a weight-sync test may change; pushed back (per tensor, fp32, over the broadcast path) afterwards
    and restored in `hf` too, so the folder's engine stays pristine."""
    state = {n: t.detach().clone() for n, t in hf.state_dict().items() if n in CHANGED}
    yield state

    async def restore() -> None:
        async with SGLangClient(engine.url) as client:
            await push_weights(client, list(state.items()), f"restore_{free_port()}")

    run(restore())
    with torch.no_grad():
        for name, tensor in state.items():
            hf.get_parameter(name).copy_(tensor)
