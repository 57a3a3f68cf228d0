"""The embedded engine on a device that is not the default one, on a CPU-only machine (`tests/support/fake_cuda.py`):
every kind of request gives the tokens and log-probs of the same engine on the CPU, and a tensor-handle update waits
for its copies before it answers; the health rule counts requests that got tokens, not forwards."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support.fake_cuda import CUDA, FakeCuda
from tests.support.payloads import packed
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.server.local import LocalEngine
from userrl_megatron.server.sampling import parse_sampling_params
from userrl_megatron.server.scheduler import Request
from userrl_megatron.sync.tensor_sender import TensorSender

PROMPT = [5, 6, 7, 8, 9, 10, 11]
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("device") / "tiny", tokenizer="char")


def launch_on(device: str, path: Path, **cfg: Any) -> tuple[LocalEngine, FakeCuda | None]:
    """An engine on the CPU, or on the fake CUDA device (active on this thread while it loads, and on its
    scheduler thread from then on)."""
    if device == "cpu":
        # torch's own linear, as on the fake device (whose tensors are CPU ones): the same kernels on both sides
        return LocalEngine.launch(str(path), EmbeddedServerConfig(device="cpu", cpu_linear="torch", **cfg)), None
    cuda = FakeCuda()
    with cuda:
        engine = LocalEngine.launch(str(path), EmbeddedServerConfig(device="cuda", **cfg))
        engine.core.scheduler.call(cuda.enter).result()
    return engine, cuda


def close(engine: LocalEngine, cuda: FakeCuda | None) -> None:
    if cuda is not None:
        engine.core.scheduler.call(cuda.exit).result()
    engine.close()


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """(on the CPU, on the fake CUDA device), same model and settings."""
    cpu, _ = launch_on("cpu", tiny_dir)
    cuda, guard = launch_on("cuda", tiny_dir)
    yield cpu, cuda
    close(cuda, guard)
    cpu.close()


def run(engine: LocalEngine, params: dict[str, Any], prompt: list[int] = PROMPT, **request: Any) -> Request:
    spec = parse_sampling_params(params, engine.core.model.spec.vocab_size)
    return asyncio.run(engine.core.generate(Request(list(prompt), spec, **request)))


def test_the_fake_device_holds_the_weights_and_the_generators(engines: tuple[LocalEngine, LocalEngine]) -> None:
    _, cuda = engines
    assert cuda.core.model.device == CUDA
    assert str(cuda.core.server_info()["device"]) == "cuda:0"
    assert cuda.core.scheduler._generator.logical_device == CUDA


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7, "sampling_seed": 3},
    "top_k_top_p_min_p": {"temperature": 1.3, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "sampling_seed": 4},
    "penalties": {
        "temperature": 0.9,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.3,
        "sampling_seed": 5,
    },
    "greedy_penalties": {"temperature": 0.0, "frequency_penalty": 1.0, "repetition_penalty": 1.5},
    "logit_bias_min_new_tokens": {
        "temperature": 0.8,
        "logit_bias": {"2": 8.0, "40": 3.5, "41": -100.0},
        "min_new_tokens": 6,
        "stop_token_ids": [40],
        "sampling_seed": 6,
    },
}


@pytest.mark.parametrize("name", SAMPLING)
def test_requests_on_another_device_give_the_cpu_engines_tokens(
    engines: tuple[LocalEngine, LocalEngine], name: str
) -> None:
    """Temperatures, penalties, biases, bans and seeded generators are made on the logits' device; the result
    is the CPU engine's, token for token and log-prob for log-prob."""
    params = {"max_new_tokens": 24, **SAMPLING[name]}
    on_cpu, on_cuda = (run(engine, params, return_logprob=True, top_logprobs_num=3) for engine in engines)
    assert on_cuda.finish_reason == on_cpu.finish_reason
    assert on_cuda.finish_reason["type"] in ("length", "stop")
    assert on_cuda.output_ids == on_cpu.output_ids
    assert on_cuda.output_logprobs == on_cpu.output_logprobs
    assert on_cuda.output_top_logprobs == on_cpu.output_top_logprobs


def test_prompt_logprobs_on_another_device(engines: tuple[LocalEngine, LocalEngine]) -> None:
    for start in (0, 3):
        on_cpu, on_cuda = (
            run(
                engine,
                {"max_new_tokens": 4, "temperature": 0.0},
                return_logprob=True,
                logprob_start_len=start,
                top_logprobs_num=2,
            )
            for engine in engines
        )
        assert len(on_cuda.input_logprobs) == len(PROMPT) - start
        assert on_cuda.input_logprobs == on_cpu.input_logprobs
        assert on_cuda.input_top_logprobs == on_cpu.input_top_logprobs
        assert on_cuda.output_ids == on_cpu.output_ids


def test_unseeded_sampling_uses_the_engines_generator_on_its_device(tiny_dir: Path) -> None:
    """Requests without a seed draw from the engine's generator (seeded by `random_seed`), which must live on the
    engine's device: two fresh engines with the same seed give the same tokens."""
    (cpu, _), (cuda, guard) = launch_on("cpu", tiny_dir, random_seed=11), launch_on("cuda", tiny_dir, random_seed=11)
    try:
        params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}  # 16 tokens whatever is drawn
        for _ in range(2):
            on_cpu, on_cuda = run(cpu, params), run(cuda, params)
            assert on_cuda.finish_reason == {"type": "length", "length": 16}
            assert on_cuda.output_ids == on_cpu.output_ids
    finally:
        close(cuda, guard)
        cpu.close()


def test_batched_decoding_prefix_reuse_and_weight_release_on_another_device(tiny_dir: Path) -> None:
    """Mixed requests decoded together, a second turn reusing the first's KV from the prefix cache, and the
    weights released to their host copy and brought back (`enable_weights_cpu_backup` on a GPU)."""
    (cpu, _), (cuda, guard) = (
        launch_on(d, tiny_dir, prefix_cache_tokens=4096, enable_weights_cpu_backup=True) for d in ("cpu", "cuda")
    )
    prompts = [PROMPT, [3, 4], list(range(20, 60))]
    params = [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 9}, {"temperature": 0.5, "top_p": 0.9}]

    def turns(engine: LocalEngine) -> list[Request]:
        async def scenario() -> list[Request]:
            vocab = engine.core.model.spec.vocab_size
            specs = [
                parse_sampling_params({"max_new_tokens": 12, "sampling_seed": i, **p}, vocab)
                for i, p in enumerate(params)
            ]
            first = await asyncio.gather(
                *(engine.core.generate(Request(list(p), s)) for p, s in zip(prompts, specs, strict=True))
            )
            await engine.release_memory(["weights", "kv_cache"])
            await engine.resume_memory(["weights", "kv_cache"])
            second = [p + r.output_ids + [12, 13] for p, r in zip(prompts, first, strict=True)]
            again = await asyncio.gather(
                *(engine.core.generate(Request(p, s)) for p, s in zip(second, specs, strict=True))
            )
            return [*first, *again]

        return asyncio.run(scenario())

    try:
        on_cpu, on_cuda = turns(cpu), turns(cuda)
        assert guard is not None and guard.is_on_device(next(cuda.core.model.model.parameters()))
        for a, b in zip(on_cpu, on_cuda, strict=True):
            assert b.finish_reason == a.finish_reason == {"type": "length", "length": 12}
            assert (b.output_ids, b.output_logprobs, b.cached_tokens) == (
                a.output_ids,
                a.output_logprobs,
                a.cached_tokens,
            )
    finally:
        close(cuda, guard)
        cpu.close()


def test_a_tensor_update_on_the_device_waits_for_its_copies(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine on a GPU answers a tensor-handle update only after its copies out of the sender's segment ran: the
    sender writes the next bucket but one there as soon as it has the answer."""
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(torch.device(device)))
    engine, guard = launch_on("cuda", tiny_dir)
    name = "model.norm.weight"
    value = torch.full(tuple(engine.core.model.model.get_parameter(name).shape), 0.5)
    packer = packed([(name, value)])
    payload = TensorSender._payload(packer, own_format=True)  # as the trainer writes it to this engine

    async def update() -> tuple[bool, str]:
        await engine.core.begin_weight_update()
        try:
            return await engine.core.update_weights_from_tensor([payload], "flattened_bucket", flush_cache=False)
        finally:
            await engine.core.end_weight_update()

    try:
        assert asyncio.run(update()) == (True, "Success")
        assert waited == [CUDA]
        assert torch.equal(engine.core.model.model.get_parameter(name).detach(), value)
    finally:
        close(engine, guard)
        packer.buffer.release()


# ---- the health rule ----


class FailingOp(TorchFunctionMode):
    """Raises in every call of one torch function on the thread it is entered on: a fault after the forward."""

    def __init__(self, name: str, message: str):
        super().__init__()
        self.name, self.message = name, message

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") == self.name:
            raise RuntimeError(self.message)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def engine(tiny_dir: Path) -> Iterator[LocalEngine]:
    eng = LocalEngine.launch(str(tiny_dir), EmbeddedServerConfig(device="cpu", health_check_timeout_s=600.0))
    yield eng
    eng.close()


def test_an_engine_whose_every_request_fails_is_not_healthy(engine: LocalEngine) -> None:
    """The forward runs, the sampler fails: every request ends with the engine's error and the health probe
    says so at once, though forwards completed after it was sent."""
    assert asyncio.run(engine.health()) is True
    fault = FailingOp("log_softmax", ILLEGAL_ACCESS)
    engine.core.scheduler.call(fault.__enter__).result()
    try:
        failed = run(engine, {"max_new_tokens": 4, "temperature": 0.0})
        assert failed.output_ids == []
        assert failed.finish_reason == {
            "type": "abort",
            "message": f"engine error: {ILLEGAL_ACCESS}",
            "status_code": 500,
            "err_type": "RuntimeError",
        }
        assert asyncio.run(engine.health()) is False
    finally:
        engine.core.scheduler.call(lambda: fault.__exit__(None, None, None)).result()
    assert asyncio.run(engine.health()) is True


def test_progress_is_a_token_not_a_forward(engine: LocalEngine) -> None:
    """A request whose decode step runs its forward but cannot sample ends with the engine's error and leaves
    `last_progress` where its last token put it."""
    fault = FailingOp("log_softmax", ILLEGAL_ACCESS)
    seen: list[float] = []

    def arm(request: Request) -> None:  # on the scheduler thread, after the request's first token
        if not seen:
            seen.append(engine.core.scheduler.last_progress)
            fault.__enter__()

    decode_steps = engine.core.scheduler.decode_steps
    try:
        failed = run(engine, {"max_new_tokens": 8, "temperature": 0.0}, on_token=arm)
    finally:
        engine.core.scheduler.call(lambda: fault.__exit__(None, None, None)).result()
    assert engine.core.scheduler.last_progress == seen[0]
    assert engine.core.scheduler.decode_steps == decode_steps + 1  # the forward ran
    assert len(failed.output_ids) == 1
    assert failed.finish_reason == {
        "type": "abort",
        "message": f"engine error: {ILLEGAL_ACCESS}",
        "status_code": 500,
        "err_type": "RuntimeError",
    }


def test_a_probe_aborted_by_a_caller_still_counts(engine: LocalEngine) -> None:
    """SGLang counts any answer from its scheduler, an abort included; only the engine's own failure does not."""

    async def probe_while_paused() -> bool:
        await engine.pause("in_place")
        health = asyncio.ensure_future(engine.health())
        while engine.core.scheduler.counts()[1] == 0:  # the probe is queued
            await asyncio.sleep(0.01)
        engine.core.abort_request(abort_all=True)
        try:
            return await health
        finally:
            await engine.resume()

    assert asyncio.run(probe_while_paused()) is True


# ---- the fake device itself ----


def test_fake_cuda_refuses_what_cuda_refuses() -> None:
    with FakeCuda():
        logits = torch.zeros(2, 5, device="cuda")
        host = torch.ones(2)
        assert logits.device == CUDA and logits.is_cuda and not host.is_cuda
        with pytest.raises(
            RuntimeError,
            match=r"^Expected all tensors to be on the same device, but found at least "
            r"two devices, cuda:0 and cpu! \(div\)$",
        ):
            logits / host.unsqueeze(1)
        assert (logits / torch.tensor(2.0)).device == CUDA  # a zero-dimensional host tensor is a scalar
        assert logits[torch.tensor([1])].device == CUDA  # host indices are fine for advanced indexing
        logits[:, 0] = host  # basic indexing copies across devices
        with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device"):
            logits[torch.tensor([0, 1])] = torch.ones(2, 5)
        with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device"):
            logits.gather(1, torch.zeros(2, 1, dtype=torch.long))
        with pytest.raises(RuntimeError, match=r"^Expected a 'cuda' device type for generator but found 'cpu'$"):
            torch.multinomial(logits.softmax(-1), 1, generator=torch.Generator().manual_seed(0))
        assert torch.multinomial(logits.softmax(-1), 1, generator=torch.Generator(device="cuda")).device == CUDA
        with pytest.raises(TypeError, match=r"^can't convert cuda:0 device type tensor to numpy"):
            logits.numpy()
        back = logits.cpu()
        assert back.device == torch.device("cpu") and logits.device == CUDA
        assert host.to(logits.device).device == CUDA and host.device == torch.device("cpu")
    assert torch.Generator is torch._C.Generator
