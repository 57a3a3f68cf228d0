"""The trainer's periodic evaluation writes `userrl eval`'s outputs per evaluated step (same metrics code)."""

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import tiny_run, train

pytestmark = pytest.mark.distributed


def test_training_evaluations_write_results_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from userrl_megatron.cli import main

    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=3, tokenizer="char", num_hidden_layers=2)
    overrides = [*tiny_run(model, tmp_path, "run", 1), "eval.every_steps=1", "eval.before_training=true"]
    records = train([*overrides, "eval.max_tasks=3", "checkpoint.every_steps=0", "logging.rollout_dump_every=0"])
    by_step = {r["step"]: r for r in records}
    for step in (0, 1):
        out = tmp_path / "run" / "eval" / f"step_{step}"
        results = json.loads((out / "results.json").read_text())
        assert results["step"] == step and results["policy"]["kind"] == "training"
        echo = results["gyms"]["echo"]
        assert echo["items"] == 3 and echo["episodes"] == 3
        # one greedy episode per task: UserRL's mean of means is the trainer's mean return
        assert echo["metrics"]["mean"] == pytest.approx(by_step[step]["eval/reward_mean"], abs=1e-6)
        assert "| echo " in (out / "report.md").read_text()
        assert len((out / "episodes.jsonl").read_text().splitlines()) == 3

    capsys.readouterr()
    assert main(["eval", "--steps", str(tmp_path / "run")]) == 0  # score vs step
    printed = capsys.readouterr().out
    assert f"step 0: echo {by_step[0]['eval/reward_mean']:.3f}" in printed
    with Image.open(tmp_path / "run" / "eval" / "steps.png") as png:
        assert png.format == "PNG"
