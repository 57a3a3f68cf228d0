"""Resume and pruning follow the run's history (`latest`), never lose the good checkpoint, and survive what an
unlucky operator leaves in `checkpoints/`: damaged checkpoints, links, truncated metadata, a pointer outside.

Each sequence is the one a run goes through (save = stage, manifest, commit, prune, as `save_state` does; resume
= `newest_intact(checkpoints_newest_first(...))`, as the RL and SFT trainers do), on real directories."""

import json
import logging
import os
from pathlib import Path

import pytest

from userrl_megatron.config import ConfigError, load_config
from userrl_megatron.run.checkpoint_files import (
    EXTRA_FILE,
    FORMAT_VERSION,
    LATEST,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    checkpoints_newest_first,
    commit,
    find_damage,
    newest_intact,
    prune,
    read_metadata,
    resolve,
    write_manifest,
)
from userrl_megatron.trainer.preflight import check_before_start, finished_step

LOGGER = "userrl_megatron.run.checkpoint_files"
DATA = "model.distcp"


def save(root: Path, step: int, keep_last: int | None = None) -> Path:
    """Write checkpoint `step_<step>` as `save_state` does: files, manifest, commit (moves `latest`), prune."""
    tmp = root / f".step_{step}.incomplete"
    tmp.mkdir(parents=True)
    (tmp / DATA).write_bytes(bytes(64))
    meta = {"format_version": FORMAT_VERSION, "steps": step, "saved_at": float(step)}
    (tmp / META_FILE).write_text(json.dumps(meta) + "\n")
    (tmp / EXTRA_FILE).write_text(json.dumps({"step": step}) + "\n")
    write_manifest(tmp)
    commit(tmp, root / f"step_{step}")
    if keep_last is not None:
        prune(root, keep_last)
    return root / f"step_{step}"


def resume(root: Path) -> Path | None:
    """The checkpoint a resume (`checkpoint.resume: auto`) loads."""
    return newest_intact(checkpoints_newest_first(root))


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_damaged_newest_fall_back_save_keep_last_1_keeps_the_new_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    save(root, 20)
    save(root, 30)
    os.truncate(root / "step_30" / DATA, 32)
    damage = f"{DATA} has 32 bytes, 64 were written"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resume(root) == root / "step_20"
        save(root, 25, keep_last=1)  # the resumed run's next checkpoint, below the damaged one
    assert names(root) == [LATEST, "step_25", "step_30"]  # the damaged one is the person's to look at
    assert (root / LATEST).read_text() == "step_25\n"
    assert messages(caplog) == [
        f"checkpoint {root / 'step_30'} is damaged ({damage}): resuming from {root / 'step_20'} instead",
        f"pruning {root} left step_30 (damaged: {damage}): not counted as kept; delete when no longer needed",
    ]
    assert checkpoints_newest_first(root) == [root / "step_25"]  # step_30 is the abandoned history's
    assert resume(root) == root / "step_25"


def test_two_damaged_newer_checkpoints_do_not_take_the_good_ones_with_keep_last_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        save(root, step)
    os.truncate(root / "step_30" / DATA, 1)
    (root / "step_40" / EXTRA_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resume(root) == root / "step_20"
        save(root, 25, keep_last=2)
    assert names(root) == [LATEST, "step_20", "step_25", "step_30", "step_40"]
    assert messages(caplog) == [
        f"checkpoint {root / 'step_40'} is damaged ({EXTRA_FILE} is missing): resuming from {root / 'step_30'} instead",
        f"checkpoint {root / 'step_30'} is damaged ({DATA} has 1 bytes, 64 were written): resuming from "
        f"{root / 'step_20'} instead",
        f"pruning {root} left step_40 (damaged: {EXTRA_FILE} is missing), step_30 (damaged: {DATA} has 1 bytes, 64 "
        "were written): not counted as kept; delete when no longer needed",
    ]
    assert checkpoints_newest_first(root) == [root / "step_25", root / "step_20"]


def test_a_symlink_in_checkpoints_is_skipped_with_a_warning_never_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    elsewhere = save(tmp_path / "elsewhere", 0)  # another run's checkpoint, linked in by hand
    root.mkdir()
    (root / "step_0").symlink_to(elsewhere, target_is_directory=True)
    save(root, 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        save(root, 2, keep_last=1)
        assert checkpoints_newest_first(root) == [root / "step_2"]
    link = f"{root / 'step_0'} is a symbolic link: skipped (checkpoints are never followed through links)"
    assert messages(caplog) == [link, link]
    assert names(root) == [LATEST, "step_0", "step_2"]
    assert (root / "step_0").is_symlink() and find_damage(elsewhere) is None


def test_saving_over_a_linked_checkpoint_replaces_the_link_only(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    elsewhere = save(tmp_path / "elsewhere", 3)
    root.mkdir()
    (root / "step_3").symlink_to(elsewhere, target_is_directory=True)
    save(root, 3, keep_last=1)
    assert not (root / "step_3").is_symlink() and find_damage(root / "step_3") is None
    assert names(root) == [LATEST, "step_3"]
    assert names(elsewhere) == [EXTRA_FILE, MANIFEST_FILE, DATA, META_FILE]  # the link's target is untouched


def test_truncated_metadata_is_damage_the_listing_and_prune_get_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    legacy = save(root, 1)
    (legacy / MANIFEST_FILE).unlink()  # written before manifests: its metadata is all there is to check
    os.truncate(legacy / META_FILE, 10)
    save(root, 2)
    save(root, 3)
    written = (root / "step_3" / META_FILE).stat().st_size
    os.truncate(root / "step_3" / META_FILE, 10)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resume(root) == root / "step_2"
        save(root, 3, keep_last=1)  # the resumed run saves its step 3 again
    assert messages(caplog) == [
        f"checkpoint {root / 'step_3'} is damaged ({META_FILE} has 10 bytes, {written} were written): resuming from "
        f"{root / 'step_2'} instead",
        f"pruning {root} left step_1 (damaged: {META_FILE} is unreadable): not counted as kept; delete when no "
        "longer needed",
    ]
    assert names(root) == [LATEST, "step_1", "step_3"]
    assert find_damage(root / "step_3") is None


def test_a_damaged_only_checkpoint_is_an_error_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    save(root, 1)
    written = (root / "step_1" / META_FILE).stat().st_size
    os.truncate(root / "step_1" / META_FILE, 3)
    with pytest.raises(CheckpointError) as e:
        resume(root)
    assert str(e.value) == (
        f"checkpoint {root / 'step_1'} is damaged ({META_FILE} has 3 bytes, {written} were written) and no older "
        "one is kept: move it away to restart the run from its initial weights"
    )


@pytest.mark.parametrize("where", ["../elsewhere/step_9", "absolute", "..", ""])
def test_a_latest_pointer_outside_the_run_is_an_error_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    root = tmp_path / "checkpoints"
    outside = save(tmp_path / "elsewhere", 9)
    save(root, 1)
    save(root, 2)
    name = str(outside) if where == "absolute" else where
    (root / LATEST).write_text(name + "\n")
    error = f"{root / LATEST} points outside {root} ({name!r}): it may only name a checkpoint beside it"
    for reader in (resolve, read_metadata, checkpoints_newest_first):
        with pytest.raises(CheckpointError) as e:
            reader(root)
        assert str(e.value) == error
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert prune(root, keep_last=1) == [root / "step_1"]  # by step, the pointer not trusted; never raises
    assert messages(caplog) == [f"pruning {root}: {error}; only the checkpoint just written is known to be current"]
    assert names(root) == [LATEST, "step_2"] and find_damage(outside) is None


def test_a_latest_pointer_naming_a_link_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    outside = save(tmp_path / "elsewhere", 9)
    save(root, 1)
    (root / "step_9").symlink_to(outside, target_is_directory=True)
    (root / LATEST).write_text("step_9\n")
    with pytest.raises(CheckpointError) as e:
        resolve(root)
    assert str(e.value) == (
        f"{root / LATEST} names {root / 'step_9'}, a symbolic link: it may only name a checkpoint beside it"
    )


def test_train_refuses_a_latest_pointer_outside_the_run_before_starting(tmp_path: Path) -> None:
    save(tmp_path / "other" / "checkpoints", 4)  # a finished run beside this one
    root = tmp_path / "r" / "checkpoints"
    save(root, 2)
    (root / LATEST).write_text("../../other/checkpoints/step_4\n")
    (tmp_path / "r" / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    cfg = load_config(
        overrides=[f"run.output_dir={tmp_path}", "run.name=r", "run.total_steps=4", "checkpoint.save_hf=false"]
    )
    assert finished_step(cfg) is None  # the other run's step 4 does not finish this one
    with pytest.raises(ConfigError) as e:
        check_before_start(cfg, on_gpu=False)
    assert e.value.problems == [
        f"{root / LATEST} points outside {root} ('../../other/checkpoints/step_4'): it may only name a checkpoint "
        "beside it"
    ]
