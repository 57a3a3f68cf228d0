"""The embedded engine on one GPU: the same equalities as on CPU (skipped without CUDA), for every kind of request
(greedy, sampled, seeded, truncated, penalised, biased, prompt log-probs), the health rule, and the CUDA rules
that the CPU tests' fake device (`tests/support/fake_cuda.py`) assumes, checked against real CUDA."""

import asyncio
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy, hf_logprobs
from tests.support.fake_cuda import FakeCuda
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.server.local import LocalEngine
from userrl_megatron.server.sampling import SampleRow, parse_sampling_params, sample
from userrl_megatron.server.scheduler import Request
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.gpu

PROMPT = [5, 6, 7, 8, 9, 10, 11]
TOLERANCE = 1e-3  # float32 log-probs, engine vs transformers on the same GPU


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engine_matches_transformers(tmp_path: Path, dtype: str) -> None:
    path = make_tiny_model("qwen3", tmp_path / "tiny", tokenizer="char")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to("cuda").eval()
    engine = LocalEngine.launch(str(path), EmbeddedServerConfig(device="cuda"), dtype=dtype)
    try:
        prompts = [[5, 6, 7, 8], [9, 10], list(range(3, 60))]
        greedy = SamplingParams(max_new_tokens=32, temperature=0.0)

        async def both():
            return await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))

        for prompt, gen in zip(prompts, asyncio.run(both()), strict=True):
            if dtype == "float32":
                assert gen.output_ids == hf_greedy(hf, prompt, 32)
            expected = hf_logprobs(hf, prompt, gen.output_ids)
            tolerance = 1e-3 if dtype == "float32" else 5e-2
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, expected, strict=True)) < tolerance
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("gpu_engine") / "tiny", tokenizer="char")


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to("cuda").eval()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[LocalEngine]:
    eng = LocalEngine.launch(str(tiny_dir), EmbeddedServerConfig(device="cuda"))
    yield eng
    eng.close()


def run(engine: LocalEngine, params: dict[str, Any], prompt: list[int] = PROMPT, **request: Any) -> Request:
    spec = parse_sampling_params(params, engine.core.model.spec.vocab_size)
    return asyncio.run(engine.core.generate(Request(list(prompt), spec, **request)))


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens], device="cuda")).logits[0].float()


def close_to(values: list[float], expected: list[float]) -> bool:
    return max(abs(a - b) for a, b in zip(values, expected, strict=True)) < TOLERANCE


def test_cuda_engine_lives_on_the_gpu(engine: LocalEngine) -> None:
    assert engine.core.model.device == torch.device("cuda", 0)
    assert engine.core.scheduler._generator.device.type == "cuda"
    assert asyncio.run(engine.health()) is True


def test_cuda_sampled_requests_and_seeds(engine: LocalEngine, hf: torch.nn.Module) -> None:
    """Log-probs of softmax(logits / T); a seed reproduces its tokens; unseeded requests draw from the engine's
    generator on the GPU."""
    params = {"max_new_tokens": 24, "temperature": 0.7, "sampling_seed": 3}
    first, again, other = run(engine, params), run(engine, params), run(engine, {**params, "sampling_seed": 4})
    assert first.finish_reason == {"type": "length", "length": 24}
    assert again.output_ids == first.output_ids and other.output_ids != first.output_ids
    assert close_to(first.output_logprobs, hf_logprobs(hf, PROMPT, first.output_ids, temperature=0.7))
    unseeded = run(engine, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True})  # any token may come
    assert unseeded.finish_reason == {"type": "length", "length": 24}
    assert close_to(unseeded.output_logprobs, hf_logprobs(hf, PROMPT, unseeded.output_ids))


def test_cuda_truncated_sampling_stays_in_the_allowed_tokens(engine: LocalEngine, hf: torch.nn.Module) -> None:
    """top_k 5 and top_p 0.6: every token is among the 5 most likely, and within the nucleus of 0.6."""
    done = run(engine, {"max_new_tokens": 24, "temperature": 1.0, "top_k": 5, "top_p": 0.6, "sampling_seed": 7})
    assert len(done.output_ids) == 24
    logits = hf_logits(hf, PROMPT + done.output_ids)
    for i, token in enumerate(done.output_ids):
        probs = logits[len(PROMPT) - 1 + i].softmax(-1)
        top = probs.topk(5)
        assert token in top.indices.tolist()
        rank = top.indices.tolist().index(token)
        assert float(top.values[:rank].sum()) <= 0.6 * float(top.values.sum()) + 1e-5


def test_cuda_penalties_bias_and_min_new_tokens(engine: LocalEngine, hf: torch.nn.Module) -> None:
    eos = hf.config.eos_token_id
    penalised = run(engine, {"max_new_tokens": 12, "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3})
    expected: list[int] = []
    for _ in range(12):  # by hand: logit -= 0.5 * count + 0.3 for every token already generated
        logits = hf_logits(hf, PROMPT + expected)[-1]
        for token in set(expected):
            logits[token] -= 0.5 * expected.count(token) + 0.3
        expected.append(int(logits.argmax()))
    assert penalised.output_ids == expected
    repeated = run(engine, {"max_new_tokens": 12, "temperature": 0.8, "repetition_penalty": 1.5, "sampling_seed": 2})
    assert repeated.finish_reason["type"] in ("length", "stop") and repeated.output_ids
    held_back = run(
        engine, {"max_new_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100.0}, "min_new_tokens": 4}
    )
    assert eos not in held_back.output_ids[:4] and held_back.output_ids[4] == eos


def test_cuda_prompt_logprobs(engine: LocalEngine, hf: torch.nn.Module) -> None:
    done = run(
        engine, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    logprobs = torch.log_softmax(hf_logits(hf, PROMPT), dim=-1)
    expected = [logprobs[i - 1, t].item() for i, t in enumerate(PROMPT) if i > 0]
    assert done.input_logprobs[0] is None and close_to(done.input_logprobs[1:], expected)
    assert done.input_top_logprobs[0] is None
    assert [[t for _, t in pairs] for pairs in done.input_top_logprobs[1:]] == logprobs[:-1].topk(2).indices.tolist()


def test_cuda_weights_released_and_resumed(engine: LocalEngine, hf: torch.nn.Module) -> None:
    async def cycle() -> None:
        await engine.release_memory(["weights", "kv_cache"])
        assert next(engine.core.model.model.parameters()).device.type == "cpu"
        await engine.resume_memory(["weights", "kv_cache"])

    asyncio.run(cycle())
    assert run(engine, {"max_new_tokens": 16, "temperature": 0}).output_ids == hf_greedy(hf, PROMPT, 16)


def test_cuda_seeded_row_draws_alone_what_it_draws_in_a_batch() -> None:
    """On CUDA a seeded row's exponential draws (one `[vocab]` row of the batch) equal those of the row alone (a
    `[1, vocab]` block): a `sampling_seed` reproduces its tokens whatever else the engine decodes."""
    vocab = 1000
    s = parse_sampling_params({"temperature": 0.9, "top_p": 0.95, "sampling_seed": 7}, vocab)
    logits = torch.randn(3, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def tokens(batch: list[SampleRow], rows: torch.Tensor) -> list[list[int]]:
        drawn = [sample(rows.clone(), batch).tokens for _ in range(16)]
        return [list(column) for column in zip(*drawn, strict=True)]

    def seeded() -> SampleRow:
        return SampleRow(s, [], torch.Generator("cuda").manual_seed(7))

    shared = torch.Generator("cuda").manual_seed(0)
    alone = tokens([seeded()], logits[:1])[0]
    batch = [SampleRow(s, [], shared), seeded(), SampleRow(s, [], shared)]
    assert tokens(batch, logits[[1, 0, 2]])[1] == alone
    assert len(set(alone)) > 3


def test_cuda_sampling_step_synchronises_once() -> None:
    """A step of 8 sampled rows (penalties, bias, bans, top-k/top-p) waits for the GPU once: the copy of the
    tokens back (CUDA's sync debug mode warns at every synchronising call)."""
    vocab = 5000
    params = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.2, "logit_bias": {"3": 1.0}}
    s = parse_sampling_params(params, vocab)
    rows = [SampleRow(s, [1, 2, 2], torch.Generator("cuda").manual_seed(i) if i % 2 else None, (4,)) for i in range(8)]
    logits = torch.randn(8, vocab, device="cuda")
    sample(logits.clone(), rows)  # warm-up: first calls may initialise CUDA state
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sample(logits.clone(), rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, syncs


# ---- the fake device of the CPU tests against real CUDA ----


def _mixed_division(device: str) -> Any:
    return torch.zeros(2, 5, device=device) / torch.ones(2, 1)


def _host_scalar(device: str) -> Any:
    return torch.zeros(2, 5, device=device) / torch.tensor(2.0)


def _host_index(device: str) -> Any:
    return torch.zeros(2, 5, device=device)[torch.tensor([1])]


def _host_values_through_advanced_index(device: str) -> Any:
    logits = torch.zeros(2, 5, device=device)
    logits[torch.tensor([0, 1])] = torch.ones(2, 5)


def _host_values_through_basic_index(device: str) -> Any:
    logits = torch.zeros(2, 5, device=device)
    logits[:, 0] = torch.ones(2)


def _gather_host_index(device: str) -> Any:
    return torch.zeros(2, 5, device=device).gather(1, torch.zeros(2, 1, dtype=torch.long))


def _host_generator(device: str) -> Any:
    return torch.multinomial(torch.ones(5, device=device), 1, generator=torch.Generator().manual_seed(0))


def _device_generator(device: str) -> Any:
    return torch.multinomial(torch.ones(5, device=device), 1, generator=torch.Generator(device=device))


def _host_generator_exponential(device: str) -> Any:
    return torch.empty(5, device=device).exponential_(generator=torch.Generator().manual_seed(0))


def _device_generator_exponential(device: str) -> Any:
    return torch.empty(5, device=device).exponential_(generator=torch.Generator(device=device))


def _pinned_copy(device: str) -> Any:
    return torch.ones(5).pin_memory().to(device, non_blocking=True) + torch.zeros(5, device=device)


def _numpy(device: str) -> Any:
    return torch.zeros(2, device=device).numpy()


CASES: dict[str, Callable[[str], Any]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _mixed_division,
        _host_scalar,
        _host_index,
        _host_values_through_advanced_index,
        _host_values_through_basic_index,
        _gather_host_index,
        _host_generator,
        _device_generator,
        _host_generator_exponential,
        _device_generator_exponential,
        _pinned_copy,
        _numpy,
    )
}


def _outcome(case: Callable[[str], Any]) -> str:
    try:
        case("cuda")
    except (RuntimeError, TypeError) as e:
        return type(e).__name__
    return "ok"


@pytest.mark.parametrize("name", CASES)
def test_fake_cuda_refuses_exactly_what_cuda_refuses(name: str) -> None:
    real = _outcome(CASES[name])
    with FakeCuda():
        fake = _outcome(CASES[name])
    assert fake == real
