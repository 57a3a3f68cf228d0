"""`userrl train` killed mid-run (SIGKILL to it and every process it started) and started again resumes from
its latest checkpoint: it loses at most the step in flight, continues the task stream where it stopped (with the
tasks of the groups over-sampling carried), and ends with the full set of steps."""

import contextlib
import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, drill_env, logged_steps, tiny_run, train_command
from tests.support.warm_start import warm_start
from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.data import load_tasks
from userrl_megatron.observability import read_metrics
from userrl_megatron.run.checkpoint_files import EXTRA_FILE
from userrl_megatron.trainer.task_stream import TaskStream

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 6
# The killed run's run.total_steps: it cannot end by itself before the kill, however far it gets while the test
# (on a busy machine, perhaps a starved one) notices its third step.
UNREACHED = 10_000


MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off"],
    # four extra groups: most steps end with groups carried over (with two, about a third carry none)
    "over_sampled": ["rollout.mode=one_step_off", "rollout.partial=true", "rollout.over_sample_groups=4"],
}


def _overrides(model: Path, out: Path, mode: str) -> list[str]:
    return [
        *MODES[mode],
        *tiny_run(model, out, "resume", STEPS),
        "gyms.echo.tasks_per_split=5",  # an epoch boundary falls inside the run
        "checkpoint.every_steps=1",
        f"checkpoint.keep_last={STEPS}",  # every checkpoint stays: the over-sampled mode reads two of them
        "logging.rollout_dump_count=100",
        "algo.mini_batches_per_step=2",  # two optimizer steps a step: the old log-probs are recomputed
    ]


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path)] if path.exists() else []


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_run_resumes_and_loses_at_most_one_step(tmp_path: Path, mode: str) -> None:
    """one_step_off: the rollout running ahead when the run dies is lost with it; the checkpoint's task stream
    is the one from before that rollout drew its tasks, so the resumed run draws them again. Over-sampled: the
    checkpoint also holds the tasks of the groups carried over, and the resumed run starts them again first."""
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=1, tokenizer="char", num_hidden_layers=2)
    if mode == "over_sampled":
        model = warm_start(model, letters="abcd")  # a random model scores 0 everywhere: no group has signal
    overrides = _overrides(model, tmp_path / "runs", mode)
    run = tmp_path / "runs" / "resume"

    killed = train_command([*overrides, f"run.total_steps={UNREACHED}"])
    log = tmp_path / "killed_run.log"
    with log.open("wb") as out:
        first = subprocess.Popen(killed, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    # over-sampled: killed once its latest checkpoint holds carried groups, which the resumed run must start again
    while len(logged_steps(run)) < 3 or (mode == "over_sampled" and not _latest_carries_groups(run)):
        assert first.poll() is None, f"the run ended before it could be interrupted:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"3 steps not done within {RUN_TIMEOUT_S:.0f} s"
        time.sleep(0.2)
    _kill_tree(first)
    done_before = logged_steps(run)
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= done_before[-1]  # a step is logged only after its checkpoint

    total = max(STEPS, saved + 2)  # at least two steps after the resume, wherever the kill landed
    resumed = [*overrides, f"run.total_steps={total}"]
    subprocess.run(train_command(resumed), cwd=REPO, check=True, timeout=RUN_TIMEOUT_S, capture_output=True)
    steps = _steps(run)
    assert steps == list(range(1, total + 1)), steps  # every step exactly once
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{total}"
    trained = [r for r in read_metrics(run / "metrics.jsonl") if "actor/loss" in r]
    assert trained and all("timing/logprobs" in r for r in trained)

    cfg = load_config(overrides=resumed)
    stream = TaskStream(load_tasks(cfg.gyms.train, "train", cfg.gyms), cfg.run.seed)
    if mode == "over_sampled":
        _check_carried_groups_run_again(run, saved, stream, cfg)
        return
    # The resumed steps used the tasks an uninterrupted run would have used.
    for step in range(1, total + 1):
        expected = sorted(t.task_id for t in stream.next(cfg.rollout.prompts_per_step))
        dump = [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert sorted({r["task_id"] for r in dump}) == sorted(set(expected)), step
        # one record an episode: a step the killed run had begun holds the resumed run's episodes only
        assert len(dump) == cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt, step


def test_a_step_checkpointed_but_not_logged_is_logged_from_its_record(tmp_path: Path) -> None:
    """A run that stops between step 2's checkpoint (taken in the training window) and its log line: the resumed
    run logs step 2 from the checkpoint's record, which holds the step's rollout statistics, update and timings,
    and finds its rollout dump already written."""
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=1, tokenizer="char", num_hidden_layers=2)
    overrides = [*_overrides(model, tmp_path / "runs", "one_step_off"), "run.total_steps=3"]
    run = tmp_path / "runs" / "resume"
    stopped = subprocess.run(
        train_command(overrides), env=drill_env("stop_after_checkpoint@2"),
        cwd=REPO, timeout=RUN_TIMEOUT_S, capture_output=True, text=True,
    )  # fmt: skip
    assert stopped.returncode == 1, stopped.stderr[-4000:]
    assert "fault drill: stopped after step 2's checkpoint, before its log line" in stopped.stderr
    assert _steps(run) == [1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"

    subprocess.run(train_command(overrides), cwd=REPO, check=True, timeout=RUN_TIMEOUT_S, capture_output=True)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert {"actor/loss", "timing/rollout_wait", "timing/logprobs", "timing/train"} <= record.keys(), record
        assert {"rollout/episodes", "train/weight_version"} <= record.keys(), record
    assert "rollout/engine_restarts" not in records[1]  # the checkpoint's record, not a log line of the run
    assert "rollout/engine_restarts" in records[0] and "rollout/engine_restarts" in records[2]
    dump = (run / "rollouts" / "step_2.jsonl").read_text().splitlines()
    assert len(dump) == 4  # prompts_per_step x n_samples_per_prompt


def _kill_tree(command: subprocess.Popen[bytes]) -> None:
    """SIGKILL `command` and every process it started (Ray's, the actor rank, the engine server) at once, as a lost
    node would, and wait until all are gone. Killing the command alone left its actor rank alive long enough to
    finish the checkpoint it was writing and move `latest` after the test had read it."""
    root = psutil.Process(command.pid)
    processes = [*root.children(recursive=True), root]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    command.wait()
    _, alive = psutil.wait_procs(processes, timeout=RUN_TIMEOUT_S)
    assert not alive, f"still running after SIGKILL: {alive}"


def _tasks_state(run: Path, step: int) -> dict[str, Any]:
    """The task stream's state in the checkpoint of `step` (with the tasks of the groups carried over)."""
    state: dict[str, Any] = json.loads((run / "checkpoints" / f"step_{step}" / EXTRA_FILE).read_text())["tasks"]
    return state


def _latest_carries_groups(run: Path) -> bool:
    """Whether the latest checkpoint of a run still writing them holds tasks of carried groups."""
    try:
        step = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
        return bool(_tasks_state(run, step)["carried"])
    except (OSError, ValueError, KeyError):
        return False


def _check_carried_groups_run_again(run: Path, saved: int, stream: TaskStream, cfg: RootConfig) -> None:
    """The resumed run's first step started the groups carried at checkpoint `saved` again, with the stream's
    next tasks, as many groups in all as the uninterrupted run had in flight; each either finished in that step
    (its rollout dump) or is carried at that step's checkpoint."""
    before, after = _tasks_state(run, saved), _tasks_state(run, saved + 1)
    carried = Counter(e["task"] for e in before["carried"])
    assert carried, "the checkpoint the run resumed from carries no group: nothing to check"
    size = before["tasks"]
    start, end = (s["epoch"] * size + s["position"] for s in (before, after))
    in_flight = cfg.rollout.prompts_per_step + cfg.rollout.over_sample_groups
    assert end - start == in_flight - carried.total(), (before, after)  # the carried ones took their places
    drawn = Counter(f"{t.gym}/{t.task_id}" for t in stream.next(end)[start:])
    started = carried + drawn
    records = [json.loads(line) for line in (run / "rollouts" / f"step_{saved + 1}.jsonl").read_text().splitlines()]
    finished = Counter(f"{r['gym']}/{r['task_id']}" for r in {r["group_id"]: r for r in records}.values())
    still_carried = Counter(e["task"] for e in after["carried"])
    assert finished <= started <= finished + still_carried, (started, finished, still_carried)
