"""Checkpoint formats for large runs: the dp_reshardable optimizer state (each rank writes and reads its own
shard), background saves written from host staging copies while training goes on, and the norms' names under
the local and Transformer Engine layer specs mapped on load, both ways."""

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from tests.support.distributed import build_actor, init_world, max_abs_diff, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.distributed

SCHEDULE = {"lr_warmup_steps": 1, "lr_schedule": "cosine", "lr_decay_steps": 8, "micro_batch_tokens": 40}


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as e:
        return str(e)
    return ""


def _dp_reshardable(rank: int, world: int, port: int, model_dir: Path, root: str, batches: list) -> dict:
    out: dict = {}
    cfg = megatron_config(**SCHEDULE)  # DP=2, distributed optimizer
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    actor.train_step(batches[0])
    actor.save(f"{root}/dp/step_1", {"step": 1})  # dp_reshardable is the default
    out["uninterrupted"] = [actor.train_step(b)["actor/loss"] for b in batches[1:]]
    resumed = build_actor(model_dir, cfg)
    resumed.load(f"{root}/dp")
    out["resumed"] = [resumed.train_step(b)["actor/loss"] for b in batches[1:]]

    tp2 = megatron_config(tp=2, **SCHEDULE)
    init_world(rank, world, port, tp2)
    other = build_actor(model_dir, tp2)
    out["refused"] = _error(lambda: other.load(f"{root}/dp"))
    other.load(f"{root}/dp", with_optimizer=False)  # the weights alone load under any layout
    out["weights_only_steps"] = other.steps
    return out


def test_dp_reshardable_optimizer_resumes_in_its_layout_and_refuses_another(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=5)
    batches = [random_batch(256, [12, 30, 7, 22], seed=s) for s in range(3)]
    root = tmp_path / "checkpoints"
    r = spawn(_dp_reshardable, 2, model_dir, str(root), batches)[0]
    for got, want in zip(r["resumed"], r["uninterrupted"], strict=True):
        assert abs(got - want) <= 1e-6, (r["resumed"], r["uninterrupted"])
    meta = json.loads((root / "dp" / "step_1" / "userrl_checkpoint.json").read_text())
    assert (meta["contents"], meta["optimizer_format"], meta["layer_spec"]) == (
        ["model", "optimizer"],
        "dp_reshardable",
        "local",
    )
    assert "dp_reshardable format, saved under {'tp': 1, 'pp': 1, 'cp': 1, 'vpp': 1}" in r["refused"]
    assert "not {'tp': 2, 'pp': 1, 'cp': 1, 'vpp': 1}" in r["refused"]
    assert "checkpoint.load_optimizer=false" in r["refused"]
    assert r["weights_only_steps"] == 1


class _LateThread(threading.Thread):
    """A writer thread that starts only when the test says so: the slowest writer possible."""

    started: ClassVar[list["_LateThread"]] = []

    def start(self) -> None:
        _LateThread.started.append(self)

    def really_start(self) -> None:
        threading.Thread.start(self)


def _background(rank: int, world: int, port: int, model_dir: Path, root: str, batches: list) -> dict:
    from userrl_megatron.megatron import checkpoint_writer

    out: dict = {}
    cfg = megatron_config(**SCHEDULE)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    actor.train_step(batches[0])
    out["at_save"] = actor.compute_logprobs(batches[1])
    checkpoint_writer.threading = SimpleNamespace(Thread=_LateThread)
    actor.save(f"{root}/step_1", {"step": 1}, background=True)
    checkpoint_writer.threading = threading
    out["latest_before_commit"] = (Path(root) / "latest").is_file()
    actor.train_step(batches[1])  # changes every parameter in place before the files are written
    actor.offload()  # and frees their storage: the writer must read its own staged copies
    actor.onload()
    out["after_step"] = actor.compute_logprobs(batches[1])
    _LateThread.started.pop().really_start()
    staging = dict(actor.checkpoint_writer._staging)
    out["committed"] = actor.finish_save(wait=True)
    actor.save(f"{root}/step_2", {"step": 2}, background=True)
    out["buffers_reused"] = all(actor.checkpoint_writer._staging[k] is v for k, v in staging.items())
    out["pending_while_writing"] = actor.checkpoint_writer.pending
    while not actor.finish_save(wait=False):  # every rank polls at the same points until all are written
        pass
    resumed = build_actor(model_dir, cfg)
    out["extra"] = resumed.load(f"{root}/step_1")
    out["resumed_logprobs"] = resumed.compute_logprobs(batches[1])
    return out


def test_background_save_writes_the_state_of_the_moment_it_was_taken(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=6)
    batches = [random_batch(256, [12, 30, 7, 22], seed=s) for s in range(2)]
    root = tmp_path / "checkpoints"
    r = spawn(_background, 2, model_dir, str(root), batches)[0]
    assert r["latest_before_commit"] is False  # committed only when every rank's files are written
    assert r["committed"] is True and r["pending_while_writing"] is True
    assert r["buffers_reused"]
    assert max_abs_diff(r["after_step"], r["at_save"]) > 1e-3  # the step did change the weights...
    assert max_abs_diff(r["resumed_logprobs"], r["at_save"]) <= 1e-6  # ...and the checkpoint has the old ones
    assert r["extra"] == {"step": 1}
    assert (root / "latest").read_text().strip() == "step_2"
    assert not any(p.name.startswith(".") for p in root.iterdir())  # no temporary leftovers


def _layer_names(rank: int, world: int, port: int, model_dir: Path, root: str, batch: object) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from userrl_megatron.megatron import checkpoint

    out: dict = {}
    cfg = megatron_config(**SCHEDULE)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    actor.train_step(batch)
    out["want"] = actor.compute_logprobs(batch)
    actor.save(f"{root}/te_names", {}, with_optimizer=False)
    out["stored_te"] = sorted(k for k in dist_checkpointing.load_tensors_metadata(f"{root}/te_names") if "norm" in k)

    original = checkpoint.model_sharded_state_dict

    def other_spec(chunks: list) -> dict:  # what a model (or writer) with the other layer spec's names asks for
        state = original(chunks)
        for tensor in nested_values(state):
            if isinstance(tensor, ShardedTensor):
                tensor.key = checkpoint.NORM_ALIASES.get(tensor.key, tensor.key)
        return state

    checkpoint.model_sharded_state_dict = other_spec
    try:
        actor.save(f"{root}/local_names", {}, with_optimizer=False)  # a checkpoint written with local names
        out["stored_local"] = sorted(
            k for k in dist_checkpointing.load_tensors_metadata(f"{root}/local_names") if "norm" in k
        )
        asks_local = build_actor(model_dir, cfg)
        asks_local.load(f"{root}/te_names")  # local names requested, TE names stored
        out["local_from_te"] = asks_local.compute_logprobs(batch)
    finally:
        checkpoint.model_sharded_state_dict = original
    asks_te = build_actor(model_dir, cfg)
    asks_te.load(f"{root}/local_names")  # TE names requested, local names stored
    out["te_from_local"] = asks_te.compute_logprobs(batch)
    return out


def test_norm_names_of_either_layer_spec_load_into_the_other(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=8)
    batch = random_batch(256, [12, 30, 7], seed=1)
    r = spawn(_layer_names, 1, model_dir, str(tmp_path), batch)[0]
    # Megatron-core's local spec saves the norms under Transformer Engine's fused names already.
    te_norms = [
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    ]
    local_norms = ["decoder.layers.input_layernorm.weight", "decoder.layers.pre_mlp_layernorm.weight"]
    qk = ["decoder.layers.self_attention.k_layernorm.weight", "decoder.layers.self_attention.q_layernorm.weight"]
    final = ["decoder.final_layernorm.weight"]
    assert r["stored_te"] == sorted(final + te_norms + qk)
    assert r["stored_local"] == sorted(final + local_norms + qk)
    assert max_abs_diff(r["local_from_te"], r["want"]) == 0.0
    assert max_abs_diff(r["te_from_local"], r["want"]) == 0.0
