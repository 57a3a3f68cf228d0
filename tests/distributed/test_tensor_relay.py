"""Tensor-handle sync from a TP group of two ranks (gloo) to two embedded engines, engine i on rank i's device:
each rank packs its own copy of every bucket, rank 1's payloads travel to rank 0, which posts one request per
engine; both engines read back bit-exact, no shared-memory file of either rank is left. A name the engines do not
have fails the push on rank 0 and stops rank 1 at the next bucket boundary, with nothing left hanging."""

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.distributed import spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import EmbeddedServerConfig, SyncConfig
from userrl_megatron.fleet.engine import SGLangClient
from userrl_megatron.fleet.launch import launch_embedded
from userrl_megatron.ports import free_port

pytestmark = pytest.mark.distributed

SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "head_dim": 64}


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def _rank(rank: int, world: int, port: int, urls: list[str], state_file: str, checkpoint: str) -> dict[str, Any]:
    import torch.distributed as dist

    from userrl_megatron.sync.sender import EngineEndpoint, UnknownWeightNameError
    from userrl_megatron.sync.tensor_sender import Peers, TensorSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = torch.load(state_file)
    engines = [
        EngineEndpoint(url, 1, first_device=i, checkpoint=checkpoint, backend="embedded") for i, url in enumerate(urls)
    ]
    peers = Peers(dist.group.WORLD, [0, 1], rank)
    sender = TensorSender(SyncConfig(bucket_mb=1), engines, "relay", peers=peers)
    sender.connect()
    out: dict[str, Any] = {"mine": sender.mine}
    before = _segments()
    try:
        bad = [*state[:5], ("decoder.final_layernorm.weight", torch.ones(256)), *state[5:]]
        try:
            out["bad"] = sender.push(bad, version=9)
        except UnknownWeightNameError as e:
            out["bad"] = str(e)
        out["metrics"] = sender.push(state, version=5)
        out["kept"] = len(_segments() - before)  # the two alternating segments, kept for the next push
        sender.keep_segments = False  # a GPU sender's: both members drop them once the engines closed the push
        sender.push(state, version=6)
        out["kept_one_push"] = len(_segments() - before)
    finally:
        sender.close()
        out["left"] = sorted(_segments() - before)
        dist.destroy_process_group()
    return out


def test_two_ranks_hand_each_engine_its_own_copy(tmp_path: Path) -> None:
    a = make_tiny_model("llama", tmp_path / "a", seed=0, tokenizer="char", **SHAPE)
    b = make_tiny_model("llama", tmp_path / "b", seed=1, tokenizer="char", **SHAPE)
    state = list(AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict().items())
    torch.save(state, tmp_path / "state.pt")
    cfg = EmbeddedServerConfig(device="cpu")
    servers = [launch_embedded(str(a), cfg, free_port(), log_path=tmp_path / f"serve{i}.log") for i in range(2)]
    try:
        results = spawn(_rank, 2, [s.url for s in servers], str(tmp_path / "state.pt"), str(a))

        async def read(url: str) -> tuple[str, dict[str, list]]:
            async with SGLangClient(url) as client:
                version = (await client.get_model_info())["weight_version"]
                return version, {n: await client.get_weights_by_name(n, truncate_size=2) for n, _ in state}

        read_back = [asyncio.run(read(s.url)) for s in servers]
    finally:
        for server in servers:
            server.stop()
    source, peer = results
    assert (source["mine"], peer["mine"]) == (1, 1)  # one payload per bucket each: engine 0's and engine 1's
    assert "has no weight named 'decoder.final_layernorm.weight'" in source["bad"]
    assert peer["bad"] == {} and peer["metrics"] == {}  # the peer only packs; the source reports
    metrics = source["metrics"]
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in state)
    assert metrics["sync/buckets"] >= 4 and metrics["sync/handles_from_peers"] == metrics["sync/buckets"]
    assert (source["kept"], peer["kept"]) == (2, 2)
    assert (source["kept_one_push"], peer["kept_one_push"]) == (0, 0)
    assert source["left"] == [] and peer["left"] == []  # closing the sender removed its files
    for version, got in read_back:
        assert version == "6"
        assert all(torch.equal(torch.tensor(got[n]), t[:2]) for n, t in state)
