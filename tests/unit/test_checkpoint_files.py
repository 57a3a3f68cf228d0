"""Checkpoint directories: the `latest` pointer, atomic replacement, pruning, compatibility checks."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tests.support.tiny_models import tiny_config
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.run.checkpoint_files import (
    FORMAT_VERSION,
    HF_METADATA,
    LATEST,
    META_FILE,
    CheckpointError,
    check_compatible,
    commit,
    hf_metadata_dir,
    prune,
    read_metadata,
    resolve,
)

ARCH = Architecture.from_hf_config(tiny_config("llama", vocab_size=250).to_dict())


def write_checkpoint(root: Path, name: str, steps: int, saved_at: float) -> Path:
    """Stage a finished checkpoint the way `save_state` does, then commit it."""
    tmp = root / f".{name}.incomplete"
    tmp.mkdir(parents=True)
    meta = {"format_version": FORMAT_VERSION, "steps": steps, "saved_at": saved_at}
    (tmp / META_FILE).write_text(json.dumps(meta))
    commit(tmp, root / name)
    return root / name


def test_commit_moves_latest_last_and_resolve_follows_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "step_1", 1, 1.0)
    write_checkpoint(tmp_path, "step_2", 2, 2.0)
    assert (tmp_path / LATEST).read_text() == "step_2\n"
    assert resolve(tmp_path) == tmp_path / "step_2"
    assert resolve(tmp_path / "step_1") == tmp_path / "step_1"
    assert read_metadata(tmp_path)["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_1", "step_2"]


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "step_1", 1, 1.0)
    write_checkpoint(tmp_path, "step_1", 7, 2.0)
    assert read_metadata(tmp_path / "step_1")["steps"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_1"]


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, f"step_{step}", step, float(step))
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    write_checkpoint(tmp_path, "backup", 0, 0.0)  # not named by a trainer: the person's, never touched
    (tmp_path / LATEST).write_text("step_3\n")
    removed = prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup", LATEST, "notes", "step_2", "step_3"]


def test_missing_and_dangling_checkpoints_are_reported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is neither a checkpoint"):
        resolve(tmp_path)
    (tmp_path / LATEST).write_text("step_9\n")
    with pytest.raises(CheckpointError, match=re.escape("points at") + ".*step_9, which is not a complete checkpoint"):
        resolve(tmp_path)


def test_compatibility_checks_model_and_vocab_padding() -> None:
    meta = {
        "format_version": FORMAT_VERSION,
        "arch": dataclasses.asdict(ARCH),
        "padded_vocab_size": 256,
        "layout": {"tp": 2},
    }
    check_compatible(meta, ARCH, tp=1)  # 250 pads to 256 at TP 1, 2 and 4
    check_compatible(meta, ARCH, tp=4)
    with pytest.raises(CheckpointError, match=re.escape("tensor_model_parallel_size = 3 pads it to 384")):
        check_compatible(meta, ARCH, tp=3)
    with pytest.raises(CheckpointError, match=re.escape("differ in {'num_layers': (4, 6)}")):
        check_compatible(meta, dataclasses.replace(ARCH, num_layers=6), tp=1)
    with pytest.raises(CheckpointError, match="checkpoint format 0 is not 1"):
        check_compatible({**meta, "format_version": 0}, ARCH, tp=1)


def test_the_hf_metadata_folder_is_not_named_like_an_export_and_old_checkpoints_still_read(tmp_path: Path) -> None:
    assert HF_METADATA == "hf_metadata"
    new, old = tmp_path / "new", tmp_path / "old"
    (new / HF_METADATA).mkdir(parents=True)
    (old / "hf").mkdir(parents=True)  # written before the rename
    assert hf_metadata_dir(new) == new / HF_METADATA
    assert hf_metadata_dir(old) == old / "hf"
    assert hf_metadata_dir(tmp_path / "none") == tmp_path / "none" / HF_METADATA
