"""CheckpointManager (run/checkpoints.py), the one checkpoint path of `userrl train` and `userrl sft`: resume past
damaged checkpoints, a damaged named checkpoint, the failed-save diagnosis, the SFT data check.

Real checkpoint directories (written as `save_state` writes them), fake actor ranks; the trainers' own `resume`
runs, so both are checked to behave the same."""

import json
import logging
import os
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.errors import RunError
from userrl_megatron.run.checkpoint_files import (
    EXTRA_FILE,
    FORMAT_VERSION,
    META_FILE,
    commit,
    find_damage,
    write_manifest,
)
from userrl_megatron.run.checkpoints import CheckpointManager
from userrl_megatron.run.run_dir import RunDir

DATA = "model.distcp"
FILES_LOGGER = "userrl_megatron.run.checkpoint_files"


class FakeActors:
    """The actor group's checkpoint calls, recorded; `load` returns the checkpoint's extra state as the ranks do."""

    def __init__(self, fail_save: BaseException | None = None, fail_finish: BaseException | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_save, self.fail_finish = fail_save, fail_finish

    def save(self, path: str, extra_state: dict[str, Any], ckpt: Any, background: bool) -> None:
        self.calls.append(("save", path))
        if self.fail_save is not None:
            raise self.fail_save

    def finish_save(self, wait: bool) -> bool:
        self.calls.append(("finish_save", str(wait)))
        if self.fail_finish is not None:
            raise self.fail_finish
        return True

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        self.calls.append(("load", path))
        return json.loads((Path(path) / EXTRA_FILE).read_text())

    def load_weights(self, path: str) -> None:
        self.calls.append(("load_weights", path))

    def export_hf(self, out_dir: str) -> str | None:
        self.calls.append(("export_hf", out_dir))
        return out_dir


class FakeSteps:
    def __init__(self) -> None:
        self.rewound: list[int] = []
        self.logged: list[int] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append(step)

    def rewind(self, step: int) -> None:
        self.rewound.append(step)


def save(root: Path, step: int, extra: dict[str, Any]) -> Path:
    """Checkpoint `step_<step>` as `save_state` writes it: files, manifest, commit (moves `latest`)."""
    tmp = root / f".step_{step}.incomplete"
    tmp.mkdir(parents=True)
    (tmp / DATA).write_bytes(bytes(64))
    (tmp / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "steps": step}) + "\n")
    (tmp / EXTRA_FILE).write_text(json.dumps(extra) + "\n")
    write_manifest(tmp)
    commit(tmp, root / f"step_{step}")
    return root / f"step_{step}"


def config(tmp_path: Path, *overrides: str) -> RootConfig:
    return load_config(
        overrides=[f"run.output_dir={tmp_path}", "run.name=r", "logging.backends=[]", "run.total_steps=4", *overrides]
    )


SAMPLES = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])]


def sft_trainer(cfg: RootConfig, actors: FakeActors) -> Any:
    from userrl_megatron.sft.tokens import Sample
    from userrl_megatron.sft.trainer import Dataset, SFTTrainer

    train = Dataset([Sample(ids, mask) for ids, mask in SAMPLES])
    return SFTTrainer(cfg, RunDir.of(cfg).root, actors, train, Dataset())


def rl_trainer(cfg: RootConfig, actors: FakeActors) -> Any:
    from userrl_megatron.trainer.driver import Trainer

    tasks = SimpleNamespace(restore=lambda state: None, state=lambda: {})
    return Trainer(cfg, RunDir.of(cfg).root, SimpleNamespace(actors=actors, tasks=tasks, pool=None, sim_pool=None))


def extra_of(kind: str, trainer: Any, step: int) -> dict[str, Any]:
    """The extra state `kind`'s trainer writes at `step`."""
    if kind == "train":
        return {"step": step, "tasks": {}, "best": 0.0, "record": {}}
    return {"kind": "sft", "step": step, "total_steps": trainer.total_steps, "data": trainer.fingerprint}


TRAINERS = {"train": rl_trainer, "sft": sft_trainer}


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_resume_loads_the_newest_intact_checkpoint_and_logs_each_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    actors = FakeActors()
    trainer = TRAINERS[kind](config(tmp_path), actors)
    root = RunDir.of(trainer.cfg).checkpoints
    for step in (1, 2, 3):
        save(root, step, extra_of(kind, trainer, step))
    os.truncate(root / "step_3" / DATA, 10)
    (root / "step_2" / EXTRA_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert trainer.resume() == 1
    assert actors.calls == [("load", str(root / "step_1"))]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"checkpoint {root / 'step_3'} is damaged ({DATA} has 10 bytes, 64 were written): resuming from "
        f"{root / 'step_2'} instead",
        f"checkpoint {root / 'step_2'} is damaged ({EXTRA_FILE} is missing): resuming from {root / 'step_1'} instead",
    ]
    assert all(r.name == FILES_LOGGER for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_a_damaged_named_checkpoint_is_an_error_naming_it(tmp_path: Path, kind: str) -> None:
    other = save(tmp_path / "other" / "checkpoints", 2, {"kind": "sft", "step": 2})  # a named SFT checkpoint
    os.truncate(other / DATA, 5)
    actors = FakeActors()
    trainer = TRAINERS[kind](config(tmp_path, f"checkpoint.resume={other}"), actors)
    with pytest.raises(RunError) as e:
        trainer.resume()
    damage = f"{DATA} has 5 bytes, 64 were written"
    assert str(e.value) in (
        f"checkpoint.resume = {other}: the checkpoint is damaged ({damage})",  # sft: resumed as named
        f"checkpoint.resume = {other}: checkpoint {other} is damaged ({damage})",  # train: its weights for step 0
    )
    assert actors.calls == []


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_a_named_path_without_a_checkpoint_is_an_error(tmp_path: Path, kind: str) -> None:
    trainer = TRAINERS[kind](config(tmp_path, f"checkpoint.resume={tmp_path / 'nothing'}"), FakeActors())
    with pytest.raises(RunError, match=f"checkpoint.resume = {tmp_path / 'nothing'}: no checkpoint there"):
        trainer.resume()


def test_an_sft_resume_on_other_data_is_refused(tmp_path: Path) -> None:
    actors = FakeActors()
    trainer = sft_trainer(config(tmp_path), actors)
    save(RunDir.of(trainer.cfg).checkpoints, 1, extra_of("sft", trainer, 1) | {"data": "another"})
    with pytest.raises(RunError, match=r"was trained on other data or another schedule \(data differ: sft files"):
        trainer.resume()
    assert actors.calls == []


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_save_names_the_cause_the_free_space_and_the_intact_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    run = RunDir(tmp_path / "r")
    save(run.checkpoints, 1, {"step": 1})
    save(run.checkpoints, 2, {"step": 2})
    os.truncate(run.checkpoint(2) / DATA, 3)
    full = OSError(28, "No space left on device")
    wrapped = RuntimeError("ray task failed\nrank 0 traceback")
    wrapped.__cause__ = full
    actors = FakeActors(fail_finish=wrapped) if background else FakeActors(fail_save=wrapped)
    steps = FakeSteps()
    manager = CheckpointManager(run, config(tmp_path).checkpoint, actors, steps)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("userrl_megatron.run.checkpoints.shutil.disk_usage", lambda p: usage(0, 0, 3 * 2**19))
    with caplog.at_level(logging.WARNING), pytest.raises(RunError) as e:
        manager.save(3, {"step": 3}, background=background)
        manager.commit(wait=False)
    assert str(e.value) == (
        f"saving checkpoint {run.checkpoint(3)} failed (OSError: [Errno 28] No space left on device; 1.5 MiB free "
        f"there); {run.checkpoint(1)} is intact"
    )
    assert steps.rewound == [1]  # the steps logged after the intact checkpoint run again after a resume
    assert manager.saving is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"checkpoint {run.checkpoint(2)} is damaged ({DATA} has 3 bytes, 64 were written): passed over"
    ]
    assert find_damage(run.checkpoint(1)) is None


def test_a_failed_first_save_says_no_checkpoint_exists(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")  # nothing written yet, not even checkpoints/
    manager = CheckpointManager(run, config(tmp_path).checkpoint, FakeActors(fail_save=OSError("disk")), FakeSteps())
    with pytest.raises(RunError, match=r"failed \(OSError: disk; [0-9.]+ MiB free there\); no earlier checkpoint"):
        manager.save(1, {"step": 1})


def test_restore_relogs_a_step_its_log_missed_and_a_background_save_commits(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    path = save(run.checkpoints, 2, {"step": 2, "record": {"actor/loss": 1.0}})
    actors, steps = FakeActors(), FakeSteps()
    manager = CheckpointManager(run, config(tmp_path).checkpoint, actors, steps)
    assert manager.locate("auto") == path
    assert manager.restore(path)["step"] == 2
    assert (steps.rewound, steps.logged) == ([2], [2])
    manager.save(3, {"step": 3}, background=True)
    assert manager.saving == run.checkpoint(3)
    manager.commit(wait=True)
    assert manager.saving is None
    assert actors.calls[-2:] == [("save", str(run.checkpoint(3))), ("finish_save", "True")]


def test_importing_the_megatron_package_has_no_side_effect() -> None:
    import subprocess
    import sys

    from userrl_megatron.megatron.cpu import PAGED_STASH_MODULE

    code = (
        "import sys, userrl_megatron.megatron, userrl_megatron.run.checkpoint_files\n"
        f"print({PAGED_STASH_MODULE!r} in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.split() == ["False", "False"]
