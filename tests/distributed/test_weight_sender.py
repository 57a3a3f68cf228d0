"""The trainer-side WeightSender against a real embedded engine server: several double-buffered buckets per
push, buffers reused across pushes, and the engine generating exactly with the pushed weights afterwards."""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import EngineEndpoint, WeightSender
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.distributed

SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "head_dim": 64}


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _generate(url: str, prompt: list[int], n: int) -> tuple[list[int], str]:
    async def go() -> tuple[list[int], str]:
        async with SGLangClient(url) as client:
            await client.flush_cache()  # the trainer flushes after a sync: cached prefixes hold old-weight KV
            result = await client.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0))
            return result.output_ids, result.weight_version

    return asyncio.run(go())


def test_sender_pushes_buckets_and_the_engine_uses_them(tmp_path: Path) -> None:
    a = make_tiny_model("llama", tmp_path / "a", seed=0, tokenizer="char", **SHAPE)
    b = make_tiny_model("llama", tmp_path / "b", seed=1, tokenizer="char", **SHAPE)
    hf_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    server = launch_embedded(str(a), EmbeddedServerConfig(device="cpu"), free_port(), log_path=tmp_path / "serve.log")
    prompt, n = [5, 6, 7, 8], 12
    sender = WeightSender(SyncConfig(bucket_mb=1), [EngineEndpoint(server.url)], "test_sync")
    try:
        assert _generate(server.url, prompt, n)[0] == _greedy(hf_a, prompt, n)
        sender.connect("127.0.0.1", free_port())
        state = list(hf_b.state_dict().items())
        metrics = sender.push(state, version=3)
        assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in state)
        assert metrics["sync/buckets"] > 2  # 1 MB buckets of a ~5 MB model: the double buffering is exercised
        assert _generate(server.url, prompt, n) == (_greedy(hf_b, prompt, n), "3")
        sender.push(list(hf_a.state_dict().items()), version=4)  # the same buffers again
        assert _generate(server.url, prompt, n) == (_greedy(hf_a, prompt, n), "4")
    finally:
        sender.close()
        server.stop()
