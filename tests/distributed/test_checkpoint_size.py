"""Checkpoint size: without the optimizer state (`checkpoint.save_optimizer: false`) a checkpoint is the model
alone, about a quarter of a full one in fp32 (Adam's two moments and the master weights are left out), and a
run resumes from it. Saving starts no process (that a killed rank would leave behind)."""

from pathlib import Path

import pytest

from tests.support.distributed import build_actor, init_world, megatron_config, random_batch, spawn
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.distributed


def _save_both_ways(rank: int, world: int, port: int, model_dir: Path, root: str, batches: list) -> dict:
    import json

    import psutil

    cfg = megatron_config(micro_batch_tokens=40)
    init_world(rank, world, port, cfg)
    actor = build_actor(model_dir, cfg)
    actor.train_step(batches[0])
    actor.save(f"{root}/full/step_1", {"step": 1})
    actor.save(f"{root}/lean/step_1", {"step": 1}, with_optimizer=False)
    children = [" ".join(c.cmdline()) for c in psutil.Process().children(recursive=True)]
    after = actor.compute_logprobs(batches[1])
    resumed = build_actor(model_dir, cfg)
    extra = resumed.load(f"{root}/lean")
    meta = json.loads((Path(root) / "lean" / "step_1" / "userrl_checkpoint.json").read_text())
    same = resumed.compute_logprobs(batches[1]) == after
    return {"extra": extra, "contents": meta["contents"], "same": same, "children": children}


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "hf_metadata" not in p.parts[-2:])


def test_checkpoint_without_optimizer_state_is_the_model_alone(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=3)
    batches = [random_batch(256, [12, 30, 7, 22], seed=s) for s in range(2)]
    root = tmp_path / "checkpoints"
    r = spawn(_save_both_ways, 1, model_dir, str(root), batches)[0]
    assert r["contents"] == ["model"] and r["extra"] == {"step": 1} and r["same"]
    assert r["children"] == []  # the writes ran in the rank: no process of Megatron's was left to outlive it
    full, lean = _bytes(root / "full" / "step_1"), _bytes(root / "lean" / "step_1")
    assert 3.0 < full / lean < 4.5, (full, lean)  # fp32: weights + master weights + two Adam moments
