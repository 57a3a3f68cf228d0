"""One engine per backend and model for the tests of this folder: the embedded server and the real SGLang 0.5.23
server (from .venv-sglang, `make sglang`), each serving in float32 on CPU, through the launch path the rollout pool
uses, SmolLM2-135M-Instruct (a LlamaForCausalLM) and the families every shipped GPU layout serves: a tiny random
Qwen3 and a tiny random Qwen3-MoE with the real Qwen3 tokenizer. Every test here runs against all six. SGLang
start-up costs 30-100 s on 2 cores for SmolLM2 (about 25 s for the tiny models), so each server lives for the whole
folder (package scope: one engine at a time, stopped before the tests of other folders run, which need the memory),
and every test leaves it with the original weights and nothing released.

Weights are checked exactly on every engine (`mismatches`): read back by name where the engine answers
`/get_weights_by_name` (the embedded server, SGLang's Llama), else by SGLang's weights checker, whose checksums of
its fused parameters are compared with those of the reference model's state (tests/support/sglang_weights.py)."""

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.servers import push_weights
from tests.support.sglang_weights import checkpoint_state, differing, hf_tensor, sglang_names
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON, launch_sglang
from userrl_megatron.model_store import resolve_model
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import DIRECT_MIN_BYTES, EngineEndpoint
from userrl_megatron.sync.served import served_names
from userrl_megatron.wire.generation import EngineError

# Start-up took 60-110 s on 2 cores at load 12-16 (docs/benchmarks.md): the bound is for a hung server only.
STARTUP_S = 1200.0
SGLANG_CPU = SGLangConfig(max_total_tokens=16384, startup_timeout_s=STARTUP_S)
MODELS = ("smollm2", "qwen3", "qwen3_moe")  # SmolLM2-135M-Instruct; tiny random Qwen3 and Qwen3-MoE
# Largest difference to transformers' log-probs, per backend (SGLang's CPU kernels differ slightly).
LOGPROB_TOL = {"embedded": 1e-4, "sglang": 2e-3}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def read_back(url: str, names: Sequence[str], rows: int = 2) -> dict[str, torch.Tensor]:
    """The first `rows` rows of each named weight, as the engine holds it (`/get_weights_by_name`)."""
    async with SGLangClient(url) as client:
        return {n: torch.tensor(await client.get_weights_by_name(n, truncate_size=rows)) for n in names}


@dataclass
class Engine:
    """A running engine under test, the model it serves and its reference."""

    backend: str  # "embedded" or "sglang"
    model: str  # one of MODELS
    model_dir: Path  # the checkpoint the engine loaded
    server: ServerProcess
    hf: Any  # transformers' model of `model_dir` in float32: tests that change the engine's weights change it alike
    logprob_tol: float
    reads_by_name: bool = False  # the engine answers /get_weights_by_name (SGLang: only some model classes)
    changed: tuple[str, ...] = field(default=())  # the tensors weight-sync tests change (`changed_names`)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def names(self) -> frozenset[str]:
        """The checkpoint's tensor names: the ones the engine accepts."""
        names = served_names(str(self.model_dir))
        assert names is not None
        return names

    def endpoint(self) -> EngineEndpoint:
        """The engine for a weight sender, as a run describes it: names checked against its checkpoint, payloads in
        its backend's format."""
        return EngineEndpoint(self.url, checkpoint=str(self.model_dir), backend=self.backend)

    def state(self) -> dict[str, torch.Tensor]:
        """The reference's tensors under the checkpoint's names (what a push sends and the engine should hold)."""
        return checkpoint_state(self.hf, self.names)

    def tensor(self, name: str) -> torch.Tensor:
        """The reference's tensor of checkpoint name `name` (a view: copying into it changes the reference)."""
        return hf_tensor(self.hf, name)


def changed_names(hf: Any, names: frozenset[str]) -> tuple[str, ...]:
    """The tensors the weight-sync tests change: one of at least DIRECT_MIN_BYTES first (broadcast from its own
    memory with `sync.direct`), an attention projection (pushed as bfloat16), an MLP tensor (an expert's projection
    in an MoE; SmolLM2's is the large one), the final norm."""
    dense = "model.layers.0.mlp.down_proj.weight"
    mlp = dense if dense in names else "model.layers.0.mlp.experts.5.up_proj.weight"
    if hf_tensor(hf, mlp).nbytes >= DIRECT_MIN_BYTES:
        return mlp, "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"
    large = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    assert hf_tensor(hf, large).nbytes >= DIRECT_MIN_BYTES, large
    return large, "model.layers.1.self_attn.q_proj.weight", mlp, "model.norm.weight"


def mismatches(engine: Engine, names: Sequence[str], rows: int = 2) -> set[str]:
    """Where the engine's weights differ from its reference's: by name, the named tensors whose first `rows` rows
    differ; by SGLang's weights checker, every SGLang parameter whose checksum differs (all of them are compared)."""
    if engine.reads_by_name:
        got = run(read_back(engine.url, names, rows))
        return {n for n in names if not torch.equal(got[n], engine.tensor(n)[:rows].detach().float())}
    return set(differing(engine.url, engine.state()))


def expected_mismatches(engine: Engine, names: Sequence[str]) -> set[str]:
    """What `mismatches` reports when exactly the tensors `names` differ."""
    return set(names) if engine.reads_by_name else sglang_names(names)


async def _reads_by_name(url: str, name: str) -> bool:
    async with SGLangClient(url) as client:
        try:
            await client.get_weights_by_name(name, truncate_size=1)
        except EngineError:
            return False
    return True


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The checkpoint directory of each of MODELS, made on first use (the tiny ones: seed 0, the Qwen3 tokenizer,
    initializer range 0.3, which spreads the logits enough that greedy ties between kernels are rare)."""
    root, made = tmp_path_factory.mktemp("models"), {}

    def model_dir(model: str) -> Path:
        if model not in made:
            if model == "smollm2":
                made[model] = resolve_model("smollm2-135m-instruct")
            else:
                made[model] = make_tiny_model(model, root / model, tokenizer="qwen3", initializer_range=0.3)
        return made[model]

    return model_dir


@pytest.fixture(
    scope="package",
    params=[
        pytest.param((backend, model), id=f"{backend}-{model}", marks=[pytest.mark.slow] if backend == "sglang" else [])
        for backend in ("embedded", "sglang")
        for model in MODELS
    ],
)
def engine(
    request: pytest.FixtureRequest, model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    backend, model = request.param
    model_dir = model_dirs(model)
    log = tmp_path_factory.mktemp("conformance") / f"{backend}-{model}.log"
    if backend == "embedded":
        cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=STARTUP_S)
        server = launch_embedded(str(model_dir), cfg, free_port(), "float32", log_path=log)
    else:
        if not SGLANG_VENV_PYTHON.is_file():
            pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
        server = launch_sglang(SGLANG_CPU, str(model_dir), 1, free_port(), "float32", log_path=log, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(backend, model, model_dir, server, hf, LOGPROB_TOL[backend])
    engine.reads_by_name = run(_reads_by_name(server.url, "model.norm.weight"))
    engine.changed = changed_names(hf, engine.names)
    yield engine
    alive = server.alive()
    server.stop()
    assert alive, f"the {backend} server of {model} died during the suite:\n{server.log_tail(60)}"


@pytest.fixture
def originals(engine: Engine) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors a weight-sync test may change (`Engine.changed`); pushed back (per tensor, fp32, over the
    broadcast path) afterwards and restored in the reference too, so the folder's engine stays pristine."""
    state = {n: engine.tensor(n).detach().clone() for n in engine.changed}
    yield state

    async def restore() -> None:
        async with SGLangClient(engine.url) as client:
            await push_weights(client, list(state.items()), f"restore_{free_port()}")

    run(restore())
    with torch.no_grad():
        for name, tensor in state.items():
            engine.tensor(name).copy_(tensor)
