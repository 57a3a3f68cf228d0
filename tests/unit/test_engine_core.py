"""The embedded engine in-process (LocalEngine / EngineCore) against plain transformers, on a tiny random model."""

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy, hf_logprobs
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.engine import RolloutEngine
from userrl_megatron.server import scheduler as scheduler_module
from userrl_megatron.server.local import LocalEngine
from userrl_megatron.server.model import EngineModel
from userrl_megatron.server.prefill import PrefillRow
from userrl_megatron.server.sampling import SamplingSpec, parse_sampling_params
from userrl_megatron.server.scheduler import Request
from userrl_megatron.types import SamplingParams
from userrl_megatron.wire.generation import EngineError

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("engine") / "tiny", tokenizer="char")


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LocalEngine:
    eng = LocalEngine.launch(str(tiny_dir), EmbeddedServerConfig(device="cpu", prefix_cache_tokens=0))
    yield eng
    eng.close()


def prompts(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]


def run(coro):
    return asyncio.run(coro)


def test_local_engine_is_a_rollout_engine(engine: LocalEngine) -> None:
    assert isinstance(engine, RolloutEngine)


def test_greedy_matches_transformers_generate(engine: LocalEngine, hf: torch.nn.Module) -> None:
    for prompt in prompts(4, seed=1):
        gen = run(engine.generate(prompt, GREEDY))
        assert gen.output_ids == hf_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert gen.finish_reason == ("stop" if gen.output_ids[-1] == hf.config.eos_token_id else "length")


def test_logprobs_equal_a_forward_pass(engine: LocalEngine, hf: torch.nn.Module) -> None:
    prompt = prompts(1, seed=2)[0]
    greedy = run(engine.generate(prompt, GREEDY))
    assert (
        max(abs(a - b) for a, b in zip(greedy.output_logprobs, hf_logprobs(hf, prompt, greedy.output_ids), strict=True))
        < 1e-4
    )
    sampled = run(engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.7, seed=3)))
    expected = hf_logprobs(hf, prompt, sampled.output_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(sampled.output_logprobs, expected, strict=True)) < 1e-4


@pytest.mark.parametrize("forward_tokens", [scheduler_module.CPU_PREFILL_FORWARD_TOKENS, 64])
def test_32_concurrent_requests_each_equal_their_single_result(
    engine: LocalEngine, forward_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with each prefill batch cut into forwards of at most 64 padded new tokens (CPU's forward size)."""
    monkeypatch.setattr(scheduler_module, "CPU_PREFILL_FORWARD_TOKENS", forward_tokens)
    forwards: list[int] = []  # padded new tokens of each prefill forward of more than one row
    prefill = scheduler_module.run_prefill

    def recorded(model: EngineModel, rows: list[PrefillRow], **kwargs: bool) -> tuple:
        if len(rows) > 1:
            forwards.append(len(rows) * max(len(r.tokens) - r.reused for r in rows))
        return prefill(model, rows, **kwargs)

    monkeypatch.setattr(scheduler_module, "run_prefill", recorded)
    batch = prompts(32, seed=4)
    params = [GREEDY if i % 2 else SamplingParams(max_new_tokens=24, temperature=1.0, seed=i) for i in range(32)]
    single = [run(engine.generate(p, s)) for p, s in zip(batch, params, strict=True)]

    async def together():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(batch, params, strict=True)))

    for alone, joint in zip(single, run(together()), strict=True):
        assert joint.output_ids == alone.output_ids
        assert max(abs(a - b) for a, b in zip(joint.output_logprobs, alone.output_logprobs, strict=True)) < 1e-4
    assert forwards and max(forwards) <= forward_tokens


def test_requests_joining_and_leaving_mid_decode(engine: LocalEngine, hf: torch.nn.Module) -> None:
    """A long generation keeps running while short requests with longer prompts join (the cache shifts right)
    and leave, and its columns fill up (the cache grows and slides)."""
    long_prompt, others = [5, 6, 7], prompts(6, seed=5, low=60, high=120)

    async def scenario():
        long = asyncio.ensure_future(engine.generate(long_prompt, SamplingParams(max_new_tokens=150, temperature=0)))
        results = []
        for p in others:
            results.append(await engine.generate(p, SamplingParams(max_new_tokens=8, temperature=0)))
        return await long, results

    long, results = run(scenario())
    assert long.output_ids == hf_greedy(hf, long_prompt, 150)
    for p, r in zip(others, results, strict=True):
        assert r.output_ids == hf_greedy(hf, p, 8)


def test_seeded_sampling_is_reproducible(engine: LocalEngine) -> None:
    prompt = prompts(1, seed=6)[0]
    a, b, c = (run(engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=s))) for s in (7, 7, 8))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_stop_token_ids_and_length(engine: LocalEngine, hf: torch.nn.Module) -> None:
    prompt = prompts(1, seed=7)[0]
    full = hf_greedy(hf, prompt, 12)
    stop = full[5]
    first = full.index(stop)
    gen = run(engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop])))
    assert gen.output_ids == full[: first + 1] and gen.finish_reason == "stop"
    short = run(engine.generate(prompt, SamplingParams(max_new_tokens=3, temperature=0)))
    assert short.output_ids == full[:3] and short.finish_reason == "length"


def test_min_tokens_penalties_and_bias(engine: LocalEngine, hf: torch.nn.Module) -> None:
    prompt, eos = prompts(1, seed=10)[0], hf.config.eos_token_id

    def generate(**params: object) -> Request:
        spec = parse_sampling_params({"max_new_tokens": 6, "temperature": 0, **params}, hf.config.vocab_size)
        return run(engine.core.generate(Request(prompt, spec)))

    first = generate(logit_bias={str(eos): 100.0})
    assert first.output_ids == [eos] and first.finish_reason == {"type": "stop", "matched": eos}
    held_back = generate(logit_bias={str(eos): 100.0}, min_new_tokens=4)
    assert eos not in held_back.output_ids[:4] and held_back.output_ids[4] == eos
    penalised = generate(max_new_tokens=12, frequency_penalty=0.5, presence_penalty=0.3)
    expected: list[int] = []
    with torch.no_grad():  # by hand: logit -= 0.5 * count + 0.3 for every token already generated
        for _ in range(12):
            logits = hf(torch.tensor([prompt + expected])).logits[0, -1]
            for token in set(expected):
                logits[token] -= 0.5 * expected.count(token) + 0.3
            expected.append(int(logits.argmax()))
    assert penalised.output_ids == expected


def test_ignore_eos_ends_on_length_only_and_min_new_tokens_still_holds_eos_back(
    engine: LocalEngine, hf: torch.nn.Module
) -> None:
    """SGLang 0.5.23's semantics: `ignore_eos` skips the whole token-based finish (EOS and `stop_token_ids`), so
    every request runs to `max_new_tokens`; its min_new_tokens penalizer masks EOS and the stop ids all the same."""
    prompt, eos = prompts(1, seed=11)[0], hf.config.eos_token_id
    stop = (eos + 1) % hf.config.vocab_size

    def generate(**params: object) -> Request:
        spec = parse_sampling_params({"max_new_tokens": 6, "temperature": 0, **params}, hf.config.vocab_size)
        return run(engine.core.generate(Request(prompt, spec)))

    eos_forced = generate(logit_bias={str(eos): 100.0}, ignore_eos=True)
    assert eos_forced.output_ids == [eos] * 6 and eos_forced.finish_reason == {"type": "length", "length": 6}
    stop_forced = generate(logit_bias={str(stop): 100.0}, stop_token_ids=[stop], ignore_eos=True)
    assert stop_forced.output_ids == [stop] * 6 and stop_forced.finish_reason == {"type": "length", "length": 6}
    held_back = generate(logit_bias={str(eos): 100.0}, min_new_tokens=4, ignore_eos=True)
    assert eos not in held_back.output_ids[:4] and held_back.output_ids[4:] == [eos, eos]
    assert held_back.finish_reason == {"type": "length", "length": 6}
    sampled = generate(temperature=1.0, max_new_tokens=12, ignore_eos=True, sampling_seed=5)
    assert len(sampled.output_ids) == 12 and sampled.finish_reason == {"type": "length", "length": 12}


def test_bad_input_is_rejected_with_sglangs_messages(engine: LocalEngine) -> None:
    with pytest.raises(EngineError, match=r"^input_ids cannot be empty\.$"):
        run(engine.generate([], GREEDY))
    with pytest.raises(EngineError, match=r"^top_p must be in \(0, 1\], got 0.0\.$"):
        run(engine.generate([5], SamplingParams(top_p=0.0)))
    with pytest.raises(EngineError, match=r"^The input \(600 tokens\) is longer than the model's context length"):
        run(engine.generate([5] * 600, GREEDY))
    with pytest.raises(EngineError, match=r"^Requested token count exceeds the model's maximum context length of 512"):
        run(engine.generate([5] * 500, SamplingParams(max_new_tokens=13)))


def test_prefix_cache_reuses_finished_turns(tiny_dir: Path, hf: torch.nn.Module) -> None:
    """Second turns (a first turn's prompt + output + new tokens), prefilled together in one padded forward with
    prefix hits of different lengths, compute only what is new and give the tokens of a fresh computation."""
    eng = LocalEngine.launch(str(tiny_dir), EmbeddedServerConfig(device="cpu", prefix_cache_tokens=4096))
    spec = parse_sampling_params({"max_new_tokens": 16, "temperature": 0}, hf.config.vocab_size)

    async def turns():
        firsts = prompts(3, seed=8)
        outputs = [await eng.generate(p, GREEDY) for p in firsts]
        seconds = [
            p + o.output_ids + [10, 11, 12][: i + 1] for i, (p, o) in enumerate(zip(firsts, outputs, strict=True))
        ]
        done = await asyncio.gather(*(eng.core.generate(Request(p, spec)) for p in seconds))
        return firsts, outputs, seconds, done

    try:
        firsts, outputs, seconds, done = run(turns())
        for first, output, second, request in zip(firsts, outputs, seconds, done, strict=True):
            assert request.cached_tokens == len(first) + len(output.output_ids) - 1
            assert request.output_ids == hf_greedy(hf, second, 16)
        assert run(eng.core.flush_cache()) == (True, "")
        assert len(eng.core.scheduler.prefix) == 0
    finally:
        eng.close()


def test_requests_arriving_together_prefill_a_shared_prompt_once(tiny_dir: Path, hf: torch.nn.Module) -> None:
    """Requests that wait together and share their first tokens: the first is prefilled, the others wait one round
    and reuse its KV (SGLang's in-batch prefix caching), each with the tokens of a fresh computation. A shared start
    shorter than SHARED_PREFIX_TOKENS is computed by each."""
    eng = LocalEngine.launch(str(tiny_dir), EmbeddedServerConfig(device="cpu", prefix_cache_tokens=4096))
    spec = parse_sampling_params({"max_new_tokens": 8, "temperature": 0}, hf.config.vocab_size)
    n = scheduler_module.SHARED_PREFIX_TOKENS
    system = prompts(1, seed=11, low=30, high=31)[0]
    tails = prompts(4, seed=12, low=3, high=9)
    groups = {
        "one prompt four times (a GRPO group)": [system] * 4,
        "a shared system prompt": [system + tail for tail in tails],
        "a shared start one token short": [[*system[: n - 1], 90 + i, *tail] for i, tail in enumerate(tails)],
    }

    async def together(batch: list[list[int]]) -> list[Request]:
        await eng.core.pause_generation("in_place")  # every request waits before the first is taken
        tasks = [asyncio.ensure_future(eng.core.generate(Request(p, spec))) for p in batch]
        while eng.core.scheduler.counts() != (0, len(batch)):
            await asyncio.sleep(0.01)
        await eng.core.continue_generation()
        done = await asyncio.gather(*tasks)
        assert await eng.core.flush_cache() == (True, "")
        return done

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    try:
        cached = {}
        for what, batch in groups.items():
            done = run(together(batch))
            for prompt, request in zip(batch, done, strict=True):
                assert request.output_ids == hf_greedy(hf, prompt, 8), what
            cached[what] = [r.cached_tokens for r in done]
        assert cached["one prompt four times (a GRPO group)"] == [0, 29, 29, 29]
        shared = groups["a shared system prompt"]
        assert cached["a shared system prompt"] == [0] + [min(common(p, shared[0]), len(p) - 1) for p in shared[1:]]
        assert min(cached["a shared system prompt"][1:]) >= 30
        assert cached["a shared start one token short"] == [0, 0, 0, 0]
    finally:
        eng.close()


def test_pause_modes(engine: LocalEngine, hf: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = prompts(1, seed=9)[0]
    expected = hf_greedy(hf, prompt, 400)
    params = SamplingParams(max_new_tokens=400, temperature=0)
    scheduler, forward, call = engine.core.scheduler, engine.core.model.forward, engine.core.scheduler.call

    async def paused_mid_generation(mode: str):
        # The third decode forward waits until a command (the pause) is queued for the scheduler: the pause lands
        # after it, at token 4 of 400, however fast the machine decodes.
        gate_step, decoding, queued = scheduler.decode_steps + 2, threading.Event(), threading.Event()

        def gated_forward(*args: object, **kwargs: object) -> object:
            if scheduler.decode_steps == gate_step and not queued.is_set():
                decoding.set()
                queued.wait(timeout=60)
            return forward(*args, **kwargs)

        def queue_then_open(fn: Callable[[], object], needs_idle: bool = False) -> Future:
            future = call(fn, needs_idle=needs_idle)
            queued.set()
            return future

        monkeypatch.setattr(engine.core.model, "forward", gated_forward)
        monkeypatch.setattr(scheduler, "call", queue_then_open)
        task = asyncio.ensure_future(engine.generate(prompt, params))
        assert await asyncio.to_thread(decoding.wait, 60)
        await engine.pause(mode)
        running, waiting = scheduler.counts()
        held = asyncio.ensure_future(engine.generate(prompt[:5], SamplingParams(max_new_tokens=2, temperature=0)))
        deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
        while sum(scheduler.counts()) != running + waiting + 1:  # the new request reached the scheduler
            assert time.monotonic() < deadline, "the request never reached the scheduler"
            await asyncio.sleep(0.01)
        for _ in range(3):  # scheduler passes: each would admit and decode it (2 tokens) were the engine not paused
            await asyncio.wrap_future(scheduler.call(lambda: None))
        assert scheduler.counts() == (running, waiting + 1) and not held.done()  # new requests wait while paused
        await engine.resume()
        return await task, await held

    for mode in ("retract", "in_place"):
        done, held = run(paused_mid_generation(mode))
        assert done.output_ids == expected and done.finish_reason == "length"
        assert held.output_ids == hf_greedy(hf, prompt[:5], 2)
    aborted, _ = run(paused_mid_generation("abort"))
    assert aborted.finish_reason == "abort"
    assert aborted.output_ids == expected[:4]  # the prefill's token and 3 decode steps


def test_a_command_whose_caller_gave_up_is_skipped_and_the_running_requests_go_on(
    engine: LocalEngine, hf: torch.nn.Module
) -> None:
    """A control call cancelled before the scheduler reaches it (its HTTP handler timed out or its client left) is
    not run, and the requests decoding meanwhile finish as if nothing happened. Before, answering the cancelled
    future raised inside the scheduler's step, which failed every running request (seen under load: a weight-name
    check that timed out ended the rollout's requests)."""
    scheduler, prompt = engine.core.scheduler, prompts(1, seed=5)[0]
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(60)

    async def scenario() -> tuple[object, list[int]]:
        blocker = scheduler.call(hold)  # the scheduler thread waits in this command
        assert await asyncio.to_thread(holding.wait, 60)
        task = asyncio.ensure_future(engine.generate(prompt, GREEDY))
        deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
        while scheduler.counts() != (0, 1):
            assert time.monotonic() < deadline, "the request never reached the scheduler"
            await asyncio.sleep(0.01)
        ran: list[int] = []
        given_up = scheduler.call(lambda: ran.append(1))
        assert given_up.cancel()
        release.set()  # next: the request is admitted and decoded, then the cancelled command comes up
        await asyncio.wrap_future(blocker)
        return await task, ran

    done, ran = run(scenario())
    assert ran == []
    assert done.finish_reason == "length" and done.output_ids == hf_greedy(hf, prompt, GREEDY.max_new_tokens)


def test_a_failing_forward_aborts_its_requests_and_the_engine_keeps_serving(
    engine: LocalEngine, hf: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(engine.core.model, "forward", broken)
        failed = run(engine.generate([5, 6, 7], GREEDY))
    assert failed.finish_reason == "abort" and failed.output_ids == []
    assert run(engine.generate([5, 6, 7], GREEDY)).output_ids == hf_greedy(hf, [5, 6, 7], GREEDY.max_new_tokens)


def test_a_request_that_fails_inside_a_batch_fails_alone(engine: LocalEngine, hf: torch.nn.Module) -> None:
    """Two requests whose own settings make sampling raise (built past validation, as a bug would let them
    through): one at the prefill's sampling, one at its first decode step. Each ends with the engine error; the
    requests prefilled and decoded with them finish as if alone. At 84e0012 the whole batch got the error."""
    vocab = hf.config.vocab_size
    good = prompts(5, seed=11)
    at_prefill = SamplingSpec(max_new_tokens=8, min_new_tokens=2, stop_token_ids=frozenset({2**70}))
    at_decode = SamplingSpec(max_new_tokens=8, repetition_penalty=0.0)  # inf logits once a token is out: NaN probs

    async def batch() -> list[Request]:
        await engine.pause("in_place")  # everything waits, then is admitted in one prefill
        greedy = parse_sampling_params({"max_new_tokens": 8, "temperature": 0}, vocab)
        requests = [Request(p, greedy) for p in good[:3]] + [Request(good[3], at_prefill)]
        requests += [Request(good[4], at_decode), Request(good[0][:4], greedy)]
        tasks = [asyncio.ensure_future(engine.core.generate(r)) for r in requests]
        while engine.core.scheduler.counts() != (0, len(requests)):
            await asyncio.sleep(0.01)
        await engine.resume()
        return list(await asyncio.gather(*tasks))

    done = run(batch())
    assert engine.core.scheduler.decode_steps > 0
    for request, prompt in zip(done[:3] + done[5:], [*good[:3], good[0][:4]], strict=True):
        assert request.output_ids == hf_greedy(hf, prompt, 8), request.finish_reason
        assert request.finish_reason == {"type": "length", "length": 8}
    failed_prefill, failed_decode = done[3], done[4]
    assert failed_prefill.output_ids == [] and failed_decode.output_ids == [failed_decode.output_ids[0]]
    assert failed_prefill.finish_reason["status_code"] == 500 and failed_decode.finish_reason["status_code"] == 500
    assert failed_prefill.finish_reason["err_type"] == "IndexError"
    assert failed_prefill.finish_reason["message"] == (
        f"engine error: index {2**70} is out of bounds for dimension 0 with size {vocab}"
    )
    assert failed_decode.finish_reason["err_type"] == "RuntimeError"
    assert failed_decode.finish_reason["message"].startswith("engine error: probability tensor contains")
    assert run(engine.generate(good[1], GREEDY)).output_ids == hf_greedy(hf, good[1], GREEDY.max_new_tokens)


def test_the_engine_logs_each_release_and_resume_of_its_memory(
    engine: LocalEngine, hf: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    """What an engine's log shows of the colocated hand-offs (the run's engine logs; tests/e2e reads them)."""

    async def handoff() -> None:
        await engine.release_memory(["kv_cache", "cuda_graph"])
        await engine.resume_memory(["kv_cache", "cuda_graph"])

    with caplog.at_level("INFO", logger="userrl_megatron.server.core"):
        run(handoff())
    assert [r.getMessage() for r in caplog.records if r.name == "userrl_megatron.server.core"] == [
        "memory released: kv_cache, cuda_graph",
        "memory resumed: kv_cache, cuda_graph",
    ]
    assert run(engine.generate([5, 6, 7], GREEDY)).output_ids == hf_greedy(hf, [5, 6, 7], GREEDY.max_new_tokens)


def test_prefill_rows_are_cut_into_forwards_in_order_within_the_token_bound() -> None:
    rows = [PrefillRow(list(range(n)), reused) for n, reused in [(10, 0), (30, 10), (12, 0), (100, 0), (5, 0), (5, 0)]]
    groups = scheduler_module._forward_groups(rows, 40)
    position = {id(r): i for i, r in enumerate(rows)}
    assert [[position[id(r)] for r in g] for g in groups] == [[0, 1], [2], [3], [4, 5]]  # 2 x 20 fits; 100 alone
    assert scheduler_module._forward_groups(rows[:1], 1) == [rows[:1]]
