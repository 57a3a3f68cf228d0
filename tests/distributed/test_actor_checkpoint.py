"""Checkpoints: save under TP=2 (fully reshardable), resume under PP=2 and under TP=1 (DP=2), and training
continues exactly.

Also: the caller's extra state comes back, `latest` names the newest checkpoint, keep-last-N prunes the
oldest, a model-only checkpoint loads into a fresh actor, and a checkpoint of another model is refused.
"""

import json
from pathlib import Path

import pytest

from tests.support.distributed import build_actor, init_world, max_abs_diff, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

SCHEDULE = {"lr_warmup_steps": 1, "lr_schedule": "cosine", "lr_decay_steps": 8, "micro_batch_tokens": 40}


def _resume(rank: int, world: int, port: int, model_dir: Path, other_dir: Path, root: str, batches: list) -> dict:
    from userrl_megatron.megatron import checkpoint
    from userrl_megatron.run.checkpoint_files import CheckpointError

    out = {}
    cfg = megatron_config(tp=2, **SCHEDULE)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    out["first"] = [actor.train_step(b)["actor/loss"] for b in batches[:2]]
    extra = {"data_position": 2, "epoch": [0, 1]}
    actor.save(f"{root}/step_2", extra, keep_last=2, optimizer_format="fully_reshardable")  # any layout
    out["uninterrupted"] = [actor.train_step(b)["actor/loss"] for b in batches[2:]]
    actor.save(f"{root}/step_4", {"data_position": 4}, keep_last=2)
    out["logprobs_step_4"] = actor.compute_logprobs(batches[0])
    out["latest_after_2"] = (Path(root) / "latest").read_text().strip()
    # a model-only checkpoint (what hf2mcore writes) of the current weights
    modules = [c.module for c in actor.chunks]
    meta = {"steps": 0, **checkpoint.model_metadata(actor.arch, actor.layout, actor.dtype)}
    checkpoint.save_state(f"{root}-weights/model", modules, meta, actor.hf_dir)

    for name, layout in {"pp2": {"pp": 2}, "tp1_dp2": {}}.items():
        cfg = megatron_config(**layout, **SCHEDULE)
        init_world(rank, world, port, cfg)
        actor = build_actor(model_dir, cfg)
        extra = actor.load(f"{root}/step_2")
        out[name] = {
            "extra": extra,
            "steps": actor.steps,
            "resumed": [actor.train_step(b)["actor/loss"] for b in batches[2:]],
        }
    fresh = build_actor(model_dir, cfg)
    out["weights_only_extra"] = fresh.load(f"{root}-weights")  # follows the `latest` pointer
    out["weights_only_logprobs"] = fresh.compute_logprobs(batches[0])
    out["weights_only_steps"] = fresh.steps

    actor.save(f"{root}/step_5", {}, keep_last=2)
    out["after_third_save"] = sorted(p.name for p in Path(root).iterdir())
    other = build_actor(other_dir, cfg)
    try:
        other.load(root)
    except CheckpointError as e:
        out["other_model"] = str(e)
    return out


def test_resume_under_another_layout_continues_exactly(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=7)
    other_dir = make_tiny_model("qwen3", tmp_path / "qwen3_wide", seed=7, intermediate_size=192)
    batches: list[TrainBatch] = [random_batch(256, [12, 30, 7, 22, 16], seed=s) for s in range(4)]
    root = tmp_path / "checkpoints"
    results = spawn(_resume, 2, model_dir, other_dir, str(root), batches)
    r = results[0]
    for layout in ("pp2", "tp1_dp2"):
        assert r[layout]["extra"] == {"data_position": 2, "epoch": [0, 1]}
        assert r[layout]["steps"] == 2
        for got, want in zip(r[layout]["resumed"], r["uninterrupted"], strict=True):
            assert abs(got - want) <= 1e-5, (layout, r[layout]["resumed"], r["uninterrupted"])
    assert r["latest_after_2"] == "step_4"
    assert r["weights_only_extra"] == {} and r["weights_only_steps"] == 0
    assert max_abs_diff(r["weights_only_logprobs"], r["logprobs_step_4"]) <= 1e-5
    assert r["after_third_save"] == ["latest", "step_4", "step_5"]  # keep_last=2 pruned the oldest
    assert (root / "latest").read_text().strip() == "step_5"
    meta = json.loads((root / "step_5" / "userrl_checkpoint.json").read_text())
    assert (meta["steps"], meta["contents"]) == (4, ["model", "optimizer"])
    assert meta["layout"] == {"world_size": 2, "tp": 1, "pp": 1, "cp": 1, "vpp": 1}
    assert not any(p.name.startswith(".") for p in root.iterdir())  # no temporary leftovers
    assert "ffn_hidden_size" in r["other_model"] and "(128, 192)" in r["other_model"]
    assert {p.name for p in (root / "step_5" / "hf_metadata").iterdir()} >= {"config.json"}


def _save_before_first_step(rank: int, world: int, port: int, model_dir: Path, root: str, batches: list) -> dict:
    cfg = megatron_config(**SCHEDULE)  # distributed optimizer over DP=2
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    masked = [[0] * len(t) for t in batches[0].token_ids]
    skipped = actor.train_step(TrainBatch(batches[0].token_ids, masked, batches[0].advantages))
    actor.save(f"{root}/step_1", {"step": 1})  # no optimizer step yet: an update that was skipped
    uninterrupted = [actor.train_step(b)["actor/loss"] for b in batches[1:]]
    resumed = build_actor(model_dir, cfg)
    extra = resumed.load(root)
    return {
        "skipped": skipped,
        "extra": extra,
        "steps": resumed.steps,
        "uninterrupted": uninterrupted,
        "resumed": [resumed.train_step(b)["actor/loss"] for b in batches[1:]],
    }


def test_checkpoint_before_any_optimizer_step_saves_and_resumes(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=3)
    batches = [random_batch(256, [12, 30, 7, 22], seed=s) for s in range(3)]
    root = tmp_path / "checkpoints"
    r = spawn(_save_before_first_step, 2, model_dir, str(root), batches)[0]
    assert r["skipped"]["actor/skipped"] == 1.0
    meta = json.loads((root / "step_1" / "userrl_checkpoint.json").read_text())
    assert (meta["steps"], meta["contents"]) == (0, ["model"])
    assert r["extra"] == {"step": 1} and r["steps"] == 0
    for got, want in zip(r["resumed"], r["uninterrupted"], strict=True):
        assert abs(got - want) <= 1e-5, (r["resumed"], r["uninterrupted"])
