"""An independent client check: raw SGLang-format `/generate` requests and OpenAI chat requests (plain aiohttp,
not our client) to `userrl serve` running SmolLM2-135M-Instruct as a subprocess, compared with transformers."""

import asyncio
from typing import Any

import aiohttp
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.engine_ref import hf_greedy, hf_logprobs
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.fleet.launch import ServerProcess, launch_embedded
from userrl_megatron.model_store import resolve_model
from userrl_megatron.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello politely."]


@pytest.fixture(scope="module")
def smol() -> tuple[str, Any, Any]:
    path = str(resolve_model("smollm2-135m-instruct"))
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def server(smol: tuple[str, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    cfg = EmbeddedServerConfig(device="cpu", startup_timeout_s=1200)  # SmolLM2-135M on a busy CPU: a hang only
    log = tmp_path_factory.mktemp("smol") / "serve.log"
    srv = launch_embedded(smol[0], cfg, free_port(), served_model_name="smollm2", log_path=log)
    yield srv
    srv.stop()


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


async def post_all(url: str, path: str, bodies: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as session:

        async def one(body: dict) -> dict:
            async with session.post(url + path, json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        return await asyncio.gather(*(one(b) for b in bodies))


def test_generate_greedy_and_sampled_match_transformers(server: ServerProcess, smol: tuple[str, Any, Any]) -> None:
    _, tokenizer, hf = smol
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    greedy = {"max_new_tokens": 24, "temperature": 0.0}
    sampled = {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 1}
    bodies = [{"input_ids": p, "sampling_params": greedy, "return_logprob": True} for p in prompts]
    bodies.append({"input_ids": prompts[0], "sampling_params": sampled, "return_logprob": True})
    replies = asyncio.run(post_all(server.url, "/generate", bodies))  # five requests batched together
    for prompt, reply in zip(prompts, replies, strict=False):
        assert reply["output_ids"] == hf_greedy(hf, prompt, 24)
        assert reply["text"] == tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        got = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, hf_logprobs(hf, prompt, reply["output_ids"]), strict=True)) < 1e-4
    sample = replies[-1]
    got = [lp for lp, _, _ in sample["meta_info"]["output_token_logprobs"]]
    expected = hf_logprobs(hf, prompts[0], sample["output_ids"], temperature=0.8)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
    assert sample["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_openai_chat_matches_transformers(server: ServerProcess, smol: tuple[str, Any, Any]) -> None:
    _, tokenizer, hf = smol
    bodies = [
        {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
        for q in QUESTIONS[:2]
    ]
    replies = asyncio.run(post_all(server.url, "/v1/chat/completions", bodies))
    for question, reply in zip(QUESTIONS, replies, strict=False):
        expected = hf_greedy(hf, chat_ids(tokenizer, question), 24)
        choice = reply["choices"][0]
        assert choice["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert choice["finish_reason"] == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
        assert reply["usage"]["completion_tokens"] == len(expected)
        assert reply["model"] == "smollm2"


def test_text_prompt_is_tokenized_like_transformers(server: ServerProcess, smol: tuple[str, Any, Any]) -> None:
    _, tokenizer, hf = smol
    text = "The quick brown fox"
    (reply,) = asyncio.run(
        post_all(server.url, "/generate", [{"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}])
    )
    assert reply["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text))
    assert reply["output_ids"] == hf_greedy(hf, tokenizer.encode(text), 8)
