"""GPU checks of the actor (skipped without CUDA): Transformer Engine spec + packed (THD) sequences, bf16,
and offload/onload between phases. Not run on the CPU CI machine."""

from pathlib import Path

import pytest
import torch

from tests.support.distributed import (
    build_actor,
    hf_logprobs,
    init_world,
    max_abs_diff,
    megatron_config,
    random_batch,
    random_sequences,
    spawn,
)
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import ModelConfig
from userrl_megatron.types import TrainBatch

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _world() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


def _te_parity(rank: int, world: int, port: int, model_dir: Path, seqs: list[list[int]]) -> dict:
    cfg = megatron_config(tp=world, transformer_impl="transformer_engine", micro_batch_tokens=64)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    return {"packed": actor.packed, "logprobs": actor.compute_logprobs(TrainBatch(seqs, [], []))}


def test_transformer_engine_packed_logprobs_match_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformer_engine")
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=1, head_dim=64, hidden_size=256)
    seqs = random_sequences(256, [5, 23, 9, 31, 2, 14], seed=2)
    results = spawn(_te_parity, _world(), model_dir, seqs)
    assert results[0]["packed"] is True
    assert max_abs_diff(results[0]["logprobs"], hf_logprobs(model_dir, seqs)) <= 1e-4  # TF32/flash kernels


def _offload(rank: int, world: int, port: int, model_dir: Path, batch: TrainBatch) -> dict:
    cfg = megatron_config(tp=world, micro_batch_tokens=64)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    actor.train_step(batch)
    before = actor.compute_logprobs(batch)
    resident = torch.cuda.memory_allocated()
    actor.offload()
    offloaded = torch.cuda.memory_allocated()
    actor.onload()
    after = actor.compute_logprobs(batch)
    loss = actor.train_step(batch)["actor/loss"]
    return {"same": before == after, "freed": resident - offloaded, "loss": loss}


def test_offload_onload_keeps_the_state(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen2", tmp_path / "qwen2", seed=3, hidden_size=256, intermediate_size=1024)
    batch = random_batch(256, [20, 40, 33], seed=4)
    results = spawn(_offload, _world(), model_dir, batch)
    assert all(r["same"] for r in results)
    assert all(r["freed"] > 0 for r in results)
    assert all(r["loss"] == r["loss"] for r in results)  # finite, not NaN


def _bf16(rank: int, world: int, port: int, model_dir: Path, batch: TrainBatch) -> list[float]:
    from userrl_megatron.config.schema import AlgoConfig
    from userrl_megatron.megatron.actor import MegatronActor

    cfg = megatron_config(tp=world, micro_batch_tokens=64)
    init_world(rank, world, port, cfg)
    actor = MegatronActor(ModelConfig(path=str(model_dir), dtype="bfloat16"), cfg, AlgoConfig(), seed=0)
    return [actor.train_step(batch)["actor/grad_norm"] for _ in range(2)]


def test_bf16_training_steps(tmp_path: Path) -> None:
    model_dir = make_tiny_model("llama", tmp_path / "llama", seed=5, tie_word_embeddings=True)
    results = spawn(_bf16, _world(), model_dir, random_batch(256, [20, 40, 33], seed=6))
    assert all(0 < g < 1e3 for r in results for g in r)
