"""Generation protocol on every engine (both backends, each model): input ids in, output ids and log-probs out
(checked against transformers), sampling parameters, stop reasons (and `ignore_eos` over them), streamed chunks at
a `stream_interval`, abort, the three pause modes, flush, SGLang's meta_info."""

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from transformers import AutoTokenizer

from tests.conformance.conftest import Engine
from tests.support.engine_ref import hf_greedy, hf_logprobs
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.types import SamplingParams

QUESTION = "What is the capital of France?"


def chat_ids(model_dir: Path, question: str = QUESTION) -> list[int]:
    """`question` as a user turn in the model's chat template, ready for the assistant's answer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


async def post(url: str, path: str, body: dict) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text


async def get(url: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + path) as response:
        return response.status, await response.json(content_type=None)


def test_greedy_ids_and_logprobs_match_transformers(engine: Engine) -> None:
    prompt, hf = chat_ids(engine.model_dir), engine.hf

    async def go() -> tuple[Any, dict, dict]:
        async with SGLangClient(engine.url) as client:
            generation = await client.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True}
        return generation, (await post(engine.url, "/generate", body))[1], (await get(engine.url, "/model_info"))[1]

    generation, raw, info = asyncio.run(go())
    assert generation.output_ids == hf_greedy(hf, prompt, 6)
    expected = hf_logprobs(hf, prompt, generation.output_ids)
    assert max(abs(a - b) for a, b in zip(generation.output_logprobs, expected, strict=True)) < engine.logprob_tol
    assert generation.finish_reason == "length" and generation.prompt_tokens == len(prompt)
    assert generation.weight_version == info["weight_version"]
    meta = raw["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 2
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == raw["output_ids"]
    assert meta["weight_versions"] == [{"version": info["weight_version"], "start": 0, "end": 2}]
    for key in ("id", "cached_tokens", "num_retractions", "e2e_latency", "dp_rank", "cached_tokens_details"):
        assert key in meta, key
    assert isinstance(meta["response_sent_to_client_ts"], float)
    assert info["architectures"] == hf.config.architectures and info["is_generation"] is True


def test_sampling_params_and_stop_reasons(engine: Engine) -> None:
    prompt, hf = chat_ids(engine.model_dir, "Name a colour."), engine.hf
    greedy = hf_greedy(hf, prompt, 4)

    async def go() -> list[Any]:
        async with SGLangClient(engine.url) as client:
            outs = [await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=1.0, top_k=1))]
            outs.append(await client.generate(prompt, SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9)))
        stop = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": [greedy[1]]}
        outs.append((await post(engine.url, "/generate", {"input_ids": prompt, "sampling_params": stop}))[1])
        ignored = {**stop, "ignore_eos": True}  # ignore_eos skips the stop ids as well: the whole length comes
        outs.append((await post(engine.url, "/generate", {"input_ids": prompt, "sampling_params": ignored}))[1])
        return outs

    top1, sampled, stopped, ignored = asyncio.run(go())
    assert top1.output_ids == greedy  # top_k=1 at temperature 1 is greedy
    # Sampled log-probs are those of softmax(logits / temperature), before top-p truncation.
    expected = hf_logprobs(hf, prompt, sampled.output_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(sampled.output_logprobs, expected, strict=True)) < engine.logprob_tol
    stop_at = greedy.index(greedy[1]) + 1  # a random tiny model may say the stop token first
    assert stopped["output_ids"] == greedy[:stop_at]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy[1]}
    assert ignored["output_ids"] == greedy
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_stream_interval_sends_the_first_token_then_a_chunk_per_interval(engine: Engine) -> None:
    prompt = chat_ids(engine.model_dir, "Count to ten.")
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "stream_interval": 4}

    async def go() -> list[dict]:
        body = {"input_ids": prompt, "stream": True, "sampling_params": params}
        async with aiohttp.ClientSession() as session, session.post(engine.url + "/generate", json=body) as response:
            return [json.loads(line[6:]) async for line in response.content if line.startswith(b"data: {")]

    chunks = asyncio.run(go())
    counts = [len(c["output_ids"]) for c in chunks]
    # SGLang's HTTP handler hands over only the newest of the chunks that arrived while it was busy, so on a loaded
    # machine it may skip one; the embedded server sends every chunk.
    if engine.backend == "embedded":
        assert counts == [1, 5, 9, 10]
    assert set(counts) <= {1, 5, 9, 10} and sorted(set(counts)) == counts and counts[-1] == 10
    final = chunks[-1]["output_ids"]
    assert all(c["output_ids"] == final[: len(c["output_ids"])] for c in chunks)  # cumulative, as SGLang's default
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def _stream_until_first_token(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[Any, Any]:
    """Start a streamed generate and return once its first chunk arrived (the request is running)."""
    response = await session.post(url + "/generate", json={**body, "stream": True})
    async for line in response.content:
        if line.startswith(b"data: {"):
            return response, json.loads(line[6:])
    raise AssertionError("the stream ended before its first token")


async def _rest_of_stream(response: Any) -> dict:
    last = None
    async for line in response.content:
        if line.startswith(b"data: {"):
            last = json.loads(line[6:])
    response.release()
    assert last is not None
    return last


# A request that a pause or an abort must catch mid-generation: the client sends the pause or abort after the first
# token arrived; only a client stalled for hundreds of the server's decode steps would find it finished.
LONG = 512


def long_length(engine: Engine, prompt: list[int]) -> int:
    """LONG, or the most new tokens the model's context leaves after `prompt` (the tiny models have 512 positions:
    SGLang refuses a request whose prompt and max_new_tokens exceed it, tokenizer_manager.py:1353-1378)."""
    return min(LONG, engine.hf.config.max_position_embeddings - len(prompt))


def test_abort_request_returns_partial_output(engine: Engine) -> None:
    prompt = chat_ids(engine.model_dir)
    long = long_length(engine, prompt)
    body = {
        "input_ids": prompt,
        "rid": "conformance-abort",
        "sampling_params": {"max_new_tokens": long, "ignore_eos": True},
    }

    async def go() -> dict:
        async with aiohttp.ClientSession() as session:
            response, _ = await _stream_until_first_token(session, engine.url, body)
            assert (await post(engine.url, "/abort_request", {"rid": "conformance-abort"}))[0] == 200
            return await _rest_of_stream(response)

    last = asyncio.run(go())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < long


def test_pause_modes_then_continue(engine: Engine) -> None:
    prompt = chat_ids(engine.model_dir, "Count to three.")
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    reference_params = {**params, "max_new_tokens": 64}
    # The aborted request must still run when the pause lands: LONG tokens leave the client hundreds of decode steps
    # for it (64 left it 63, a few seconds of a CPU server's decoding, which a busy machine can take from the client).
    long = {**params, "max_new_tokens": long_length(engine, prompt)}

    async def paused(mode: str, sampling: dict) -> dict:
        async with aiohttp.ClientSession() as session, SGLangClient(engine.url) as client:
            response, _ = await _stream_until_first_token(
                session, engine.url, {"input_ids": prompt, "sampling_params": sampling}
            )
            await client.pause(mode)
            await client.resume()
            return await _rest_of_stream(response)

    async def go() -> tuple[list[int], dict[str, dict]]:
        status, reference = await post(
            engine.url, "/generate", {"input_ids": prompt, "sampling_params": reference_params}
        )
        assert status == 200, reference
        results = {"abort": await paused("abort", long)}
        results |= {mode: await paused(mode, params) for mode in ("retract", "in_place")}
        return reference["output_ids"], results

    reference, results = asyncio.run(go())
    aborted = results.pop("abort")
    assert (
        aborted["meta_info"]["finish_reason"]["type"] == "abort" and len(aborted["output_ids"]) < long["max_new_tokens"]
    )
    head = aborted["output_ids"][: len(reference)]
    assert head == reference[: len(head)]  # greedy: what it generated before the abort starts as the reference does
    for mode, result in results.items():  # retracted requests are recomputed, frozen ones continue
        assert result["output_ids"] == reference[:8], mode
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 8}, mode


def test_flush_cache_when_idle(engine: Engine) -> None:
    async def go() -> None:
        async with SGLangClient(engine.url) as client:
            await client.flush_cache()
            assert await client.health()

    asyncio.run(go())
