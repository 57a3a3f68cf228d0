"""Faults that must lose nothing: a damaged latest checkpoint (fallback, then a save and a prune below it), a second
run on the same directory, a full disk.

Each is a real `userrl train` of a tiny policy on EchoGym (tests/support/tiny_run.py)."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, tiny_run, train, train_command
from userrl_megatron.observability import read_metrics
from userrl_megatron.run.checkpoint_files import EXTRA_FILE, checkpoints_newest_first, find_damage

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny"), seed=5, tokenizer="char", num_hidden_layers=2)


def test_damaged_checkpoint_falls_back_and_the_run_directory_is_locked(model: Path, tmp_path: Path) -> None:
    run = tmp_path / "damaged"
    checkpoints = run / "checkpoints"
    common = tiny_run(model, tmp_path, "damaged", 4)
    train([*common, "checkpoint.every_steps=2", "checkpoint.keep_last=2"])  # step_2, step_4
    damaged = checkpoints / "step_4" / EXTRA_FILE
    os.truncate(damaged, damaged.stat().st_size // 2)

    # Falls back to step_2, then saves step_3 below the damaged step_4 and prunes to one checkpoint: the one just
    # written (latest) stays, the damaged one is left for the person, not counted.
    again = [*common, "run.total_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=1"]
    log = tmp_path / "resumed.log"
    with log.open("w") as out:
        resumed = subprocess.Popen(train_command(again), cwd=REPO, stdout=out, stderr=out)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while f"pid {resumed.pid} " not in (run / ".lock").read_text():  # poll until the new run holds the lock
        assert resumed.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    second = subprocess.run(train_command(common), cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith(f"userrl: error: run directory {run} is in use by pid")
    assert f"pid {resumed.pid} on" in second.stderr

    assert resumed.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    text, step_4 = log.read_text(), checkpoints / "step_4"
    damage = f"{EXTRA_FILE} has {damaged.stat().st_size} bytes"
    assert f"checkpoint {step_4} is damaged ({damage}" in text
    assert f"resuming from {checkpoints / 'step_2'} instead" in text
    assert f"pruning {checkpoints} left step_4 (damaged: {damage}" in text
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]  # step 3 again, logged once
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_3", "step_4"]
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    assert checkpoints_newest_first(checkpoints) == [checkpoints / "step_3"]  # what the next resume loads
    assert find_damage(checkpoints / "step_3") is None


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(model: Path, tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    train([*tiny_run(model, tmp_path, "probe", 1), "checkpoint.every_steps=1"])
    size = sum(f.stat().st_size for f in (probe / "checkpoints" / "step_1").rglob("*") if f.is_file())

    run = tmp_path / "full"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    room = int(size * 1.5) + 64 * 1024  # one checkpoint fits, a second beside it does not
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(checkpoints)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mount.stderr.decode().strip()}")
    try:
        common = [*tiny_run(model, tmp_path, "full", 2), "checkpoint.every_steps=1", "checkpoint.keep_last=2"]
        common.append("checkpoint.async_save=true")  # the failure surfaces when the background write is committed
        result = subprocess.run(train_command(common), cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert result.returncode == 1, result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"userrl: error: saving checkpoint {checkpoints / 'step_2'} failed (")
        assert last.endswith(f"{checkpoints / 'step_1'} is intact")
        cause = last.split(" failed (", 1)[1].split(" MiB free there")[0]
        assert cause.startswith("CheckpointWriteError: rank 0: "), cause  # the writer's own error, named
        free = float(last.split(" MiB free there")[0].rsplit(" ", 1)[1])
        assert free < size / 2**20  # the message says why: no room for another checkpoint
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1"]  # nothing half-written
        assert (checkpoints / "latest").read_text().strip() == "step_1"
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # step 2 never counted as done
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)
