"""Weight sync of a Qwen3-MoE actor at EP = 2 into a real embedded engine server: the experts of both EP ranks
are gathered batch by batch and streamed with their HF checkpoint names in several buckets, and the engine then
generates exactly as `transformers` does with the actor's model."""

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.distributed import build_actor, init_world, megatron_config, spawn
from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port
from userrl_megatron.types import SamplingParams

pytestmark = pytest.mark.distributed

# ~3 MB of experts (8 x 3 x 128 x 64 fp32 per layer, 4 layers): several 1 MB buckets
SHAPE = {"hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32}


def _push_from_ep2(rank: int, world: int, port: int, model_dir: str, url: str, sync_port: int) -> Any:
    from userrl_megatron.sync.sender import EngineEndpoint, WeightSender

    cfg = megatron_config(devices_per_node=world, expert_model_parallel_size=2)
    init_world(rank, world, port, cfg)
    actor = build_actor(Path(model_dir), cfg)
    weights = actor.export_hf_weights()
    if not actor.layout.is_stage_source:
        assert list(weights) == []  # EP rank 1 takes part in the expert gathers and yields nothing
        return None
    names: list[str] = []

    def recorded() -> Any:
        for name, tensor in weights:
            names.append(name)
            yield name, tensor

    sender = WeightSender(SyncConfig(bucket_mb=1), [EngineEndpoint(url)], "moe_sync")
    sender.connect("127.0.0.1", sync_port)
    try:
        return sender.push(recorded(), version=7), names
    finally:
        sender.close()


def _generate(url: str, prompt: list[int], n: int) -> tuple[list[int], str]:
    async def go() -> tuple[list[int], str]:
        async with SGLangClient(url) as client:
            await client.flush_cache()
            result = await client.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0))
            return result.output_ids, result.weight_version

    return asyncio.run(go())


def test_ep2_actor_syncs_experts_into_the_embedded_engine(tmp_path: Path) -> None:
    a = make_tiny_model(MOE_FAMILY, tmp_path / "a", seed=0, **SHAPE)
    b = make_tiny_model(MOE_FAMILY, tmp_path / "b", seed=1, **SHAPE)
    prompt, n = [5, 6, 7, 8, 200, 13], 12
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    want = hf_b.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    server = launch_embedded(str(a), EmbeddedServerConfig(device="cpu"), free_port(), log_path=tmp_path / "serve.log")
    try:
        assert _generate(server.url, prompt, n)[0] != want.tolist()  # the engine starts on the other model
        metrics, names = spawn(_push_from_ep2, 2, str(b), server.url, free_port())[0]
        assert len(names) == len(set(names))
        experts = {int(name.split(".")[5]) for name in names if ".mlp.experts." in name}
        assert experts == set(range(8))  # experts 0-3 from EP rank 0, 4-7 gathered from EP rank 1
        # every checkpoint tensor by its HF name: embedding, head, final norm; per layer q/k/v/o, q/k norms, 2 norms,
        # router, and gate/up/down of each of 8 experts
        assert len(names) == 3 + 4 * (9 + 3 * 8)
        assert metrics["sync/buckets"] >= 3
        assert _generate(server.url, prompt, n) == (want.tolist(), "7")
    finally:
        server.stop()
