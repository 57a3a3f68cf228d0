"""Colocated weight sync on one GPU (skipped without CUDA): `TensorSender` hands an embedded engine on the same
GPU CUDA IPC handles (device named by UUID) through `/update_weights_from_tensor`; the weights read back
bit-exact, and after each push the sender's two segments are given back (the engine closed its handles at
`/end_weight_update`), so a second push allocates them again and frees them again. The CPU twin of this test is
tests/conformance/test_tensor_sync.py (shared-memory files instead of IPC handles, every other line the same)."""

import asyncio
import gc
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.sync.sender import EngineEndpoint
from userrl_megatron.sync.tensor_sender import TensorSender

pytestmark = pytest.mark.gpu


def test_cuda_ipc_buckets_load_bit_exact_and_are_freed(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3", tmp_path / "tiny", tokenizer="char", intermediate_size=1024)  # 3.4 MB in fp32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = [(n, (t.detach() * 0.5 + 0.125).to("cuda")) for n, t in hf.state_dict().items() if n != "lm_head.weight"]
    cfg = EmbeddedServerConfig(device="cuda", startup_timeout_s=600)  # a bound on a hang only
    server = launch_embedded(str(path), cfg, free_port(), "float32", log_path=tmp_path / "engine.log")
    sender = TensorSender(
        SyncConfig(bucket_mb=1), [EngineEndpoint(server.url, backend="embedded")], "gpu_tensor", "cuda:0"
    )
    try:
        sender.connect()
        gc.collect()  # garbage of earlier tests in this process, collected during the push, would read as freed
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert not sender.keep_segments  # on GPU the segments last one push
        for version in (2, 3):
            metrics = sender.push(state, version=version)
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before  # both segments freed once the engine closed them
        assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in state)
        assert metrics["sync/buckets"] >= 3 and "sync/broadcast_s" not in metrics  # 1 MiB buckets

        async def read() -> dict[str, list]:
            async with SGLangClient(server.url) as client:
                assert (await client.get_model_info())["weight_version"] == "3"
                return {n: await client.get_weights_by_name(n, truncate_size=2) for n, _ in state}

        got = asyncio.run(read())
        for name, tensor in state:
            assert torch.equal(torch.tensor(got[name]), tensor[:2].cpu()), name
    finally:
        sender.close()
        server.stop()
