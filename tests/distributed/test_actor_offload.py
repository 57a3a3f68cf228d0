"""Offload frees the actor's storage on CPU as it does on a GPU (megatron/offload.py): the optimizer state and
grads first (as before a colocated weight sync), then the weights. What needs offloaded state fails with a clear
error instead of reading freed memory (a segfault on CPU, an illegal access on GPU), and after onload the actor
trains exactly as one that never moved. Two data-parallel ranks, distributed optimizer (sharded Adam state)."""

from pathlib import Path

import pytest

from tests.support.distributed import build_actor, init_world, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.megatron.offload import HOST_CHUNK_BYTES, actor_storages
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed


def _resident(actor: object) -> dict[str, int]:
    storages = actor_storages(actor.chunks, actor.optimizer, weights=True)
    return {kind: sum(s.nbytes() for s in group) for kind, group in storages.items()}


def _error(call: object) -> str:
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _cycle(rank: int, world: int, port: int, model_dir: Path, batch: TrainBatch, ckpt: str) -> dict:
    cfg = megatron_config(micro_batch_tokens=64)
    init_world(rank, world, port, cfg)
    moved, still = build_actor(model_dir, cfg), build_actor(model_dir, cfg)
    for actor in (moved, still):
        actor.train_step(batch)  # Adam's moments exist from here
    out = {"full": _resident(moved), "before": moved.compute_logprobs(batch)}
    moved.offload(weights=False)
    out["state_out"] = _resident(moved)
    out["logprobs_state_out"] = moved.compute_logprobs(batch)  # the weights stay: a sync can still read them
    out["train_state_out"] = _error(lambda: moved.train_step(batch))
    moved.offload()
    out["all_out"] = _resident(moved)
    out["host"] = (moved.parking.arena.used, moved.parking.arena.nbytes)
    out["logprobs_all_out"] = _error(lambda: moved.compute_logprobs(batch))
    out["save_all_out"] = _error(lambda: moved.save(ckpt))
    moved.onload()
    out["after"] = moved.compute_logprobs(batch)
    out["stepped"] = [actor.train_step(batch)["actor/loss"] for actor in (moved, still)]
    out["next"] = [actor.compute_logprobs(batch) for actor in (moved, still)]
    return out


def test_offload_frees_storage_and_onload_restores_it_exactly(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen2", tmp_path / "qwen2", seed=3)
    batch = random_batch(256, [20, 40, 33, 12], seed=4)
    for r in spawn(_cycle, 2, model_dir, batch, str(tmp_path / "ckpt")):
        full = r["full"]
        assert all(full[kind] > 0 for kind in ("weights", "optimizer state", "grads")), full
        assert r["state_out"] == {"weights": full["weights"], "optimizer state": 0, "grads": 0}
        # weights and optimizer state copied end to end into one 256 MiB chunk of host memory; grads not at all
        assert r["host"] == (full["weights"] + full["optimizer state"], HOST_CHUNK_BYTES)
        assert r["logprobs_state_out"] == r["before"]
        assert r["train_state_out"] == "a training step: the actor's grads, optimizer state are offloaded; onload first"
        assert r["all_out"] == {"weights": 0, "optimizer state": 0, "grads": 0}
        assert r["logprobs_all_out"] == "a log-prob pass: the actor's weights are offloaded; onload first"
        assert r["save_all_out"].startswith("a checkpoint save: the actor's optimizer state, weights are offloaded")
        assert r["after"] == r["before"]  # bit-identical
        assert r["stepped"][0] == r["stepped"][1]  # Adam's moments came back: the same step as an actor left alone
        assert r["next"][0] == r["next"][1]


def _reference_swap(rank: int, world: int, port: int, model_dir: Path, batches: list) -> dict:
    from userrl_megatron.megatron.reference import ReferenceWeights

    cfg = megatron_config()
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    reference = ReferenceWeights(params)
    initial = actor.compute_logprobs(batches[0])
    actor.train_step(batches[1])
    trained = actor.compute_logprobs(batches[0])
    buffers = [b.data_ptr() for b in reference.parked.chunks + reference.reference.chunks]
    swaps = []
    for _ in range(2):
        with reference.swapped_in(params):
            swaps.append(actor.compute_logprobs(batches[0]))
        swaps.append(actor.compute_logprobs(batches[0]))
    return {
        "initial": initial,
        "trained": trained,
        "swaps": swaps,
        "same_buffers": buffers == [b.data_ptr() for b in reference.parked.chunks + reference.reference.chunks],
    }


def test_reference_swap_scores_the_initial_weights_and_restores_the_trained_ones(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=4)
    batches = [random_batch(256, [12, 30, 7], seed=s) for s in range(2)]
    r = spawn(_reference_swap, 1, model_dir, batches)[0]
    assert r["trained"] != r["initial"]
    assert r["swaps"] == [r["initial"], r["trained"], r["initial"], r["trained"]]  # bit-exact both ways
    assert r["same_buffers"]  # host buffers allocated once, reused by every swap
