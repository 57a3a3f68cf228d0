"""How `userrl train` recognises an SFT checkpoint named by checkpoint.resume (without importing torch)."""

import json
from pathlib import Path

from userrl_megatron.config import load_config
from userrl_megatron.run.checkpoint_files import EXTRA_FILE, FORMAT_VERSION, META_FILE, commit
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.trainer.preflight import finished_step

is_sft_checkpoint = CheckpointManager.is_sft


def write_checkpoint(root: Path, step: int, extra: dict) -> Path:
    tmp = root / f".step_{step}.incomplete"
    tmp.mkdir(parents=True)
    (tmp / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "steps": step}))
    (tmp / EXTRA_FILE).write_text(json.dumps(extra))
    commit(tmp, root / f"step_{step}")
    return root / f"step_{step}"


def test_sft_checkpoints_are_recognised_and_do_not_hide_a_finished_rl_run(tmp_path: Path) -> None:
    sft = write_checkpoint(tmp_path / "sft" / "checkpoints", 10, {"kind": "sft", "step": 10})
    rl = write_checkpoint(tmp_path / "other" / "checkpoints", 3, {"step": 3, "tasks": {}})
    assert is_sft_checkpoint(sft) and is_sft_checkpoint(sft.parent)  # the folder: through its latest pointer
    assert not is_sft_checkpoint(rl) and not is_sft_checkpoint(rl.parent) and not is_sft_checkpoint(tmp_path / "none")

    overrides = [f"run.output_dir={tmp_path}", "run.name=grpo", "run.total_steps=2", "checkpoint.save_hf=false"]
    from_sft = load_config(overrides=[*overrides, f"checkpoint.resume={sft.parent}"])
    from_rl = load_config(overrides=[*overrides, f"checkpoint.resume={rl.parent}"])
    assert finished_step(from_sft) is None  # nothing trained yet: start from the SFT weights
    write_checkpoint(tmp_path / "grpo" / "checkpoints", 2, {"step": 2, "tasks": {}})
    (tmp_path / "grpo" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert finished_step(from_sft) == 2  # relaunched after it finished: nothing to start
    assert finished_step(from_rl) is None  # a named RL checkpoint is resumed as named
