"""The embedded engine on one GPU: the same equalities as on CPU (skipped without CUDA)."""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.engine_ref import hf_greedy, hf_logprobs
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig
from userrl_megatron.rollout.server.local import LocalEngine
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.gpu


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
