"""slurm/*.sbatch under a real Slurm (a single node: `tools/slurm_local.sh` starts one; `.ci/run` does it in CI).

A 2-step CPU training job finishes and leaves no Ray behind; a job cancelled mid-run stops Ray on its node
and removes its session files, and its resubmission resumes with every step logged once; convert.sbatch exports
the checkpoint; a missing environment, a wrong interface or a Ray node that cannot start fails at once, naming
what is missing; the README's one-line overrides are accepted; starting the local Slurm again changes nothing.
Skipped, with the reason, where no Slurm node is up.
"""

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.slurm import Job, cancel_all, job_env, slurm_unavailable, submit, wait_ended
from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, logged_steps, tiny_run
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_why_not = slurm_unavailable()
if _why_not:
    pytest.skip(_why_not, allow_module_level=True)

# The README's one-line override for a CPU-only single node (the #SBATCH defaults ask for 8 GPUs).
CPU_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]
POLL_S = 0.2
GONE_S = 600.0  # Ray's processes exit after their job: a bound on a hang, not on how fast they go
UNREACHED = 10_000  # run.total_steps of a job that is cancelled: it cannot end by itself before the cancel


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slurm")


@pytest.fixture(scope="module")
def jobs() -> Iterator[list[Job]]:
    submitted: list[Job] = []
    yield submitted
    cancel_all(submitted)


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return make_tiny_model("qwen3", work / "tiny", seed=1, tokenizer="char", num_hidden_layers=2)


def _train_args(model: Path, work: Path, name: str, steps: int) -> list[str]:
    return [*tiny_run(model, work / "runs", name, steps), "checkpoint.every_steps=1"]


def _submit_train(work: Path, jobs: list[Job], args: list[str], **env: str) -> Job:
    job = submit("train.sbatch", CPU_NODE, args, work / "out", job_env(work / "ray-logs", **env))
    jobs.append(job)
    return job


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path)] if path.exists() else []


def _ray_address(job: Job) -> str:
    found = re.search(r"Ray: head \S+ at (\S+),", job.log())
    assert found, f"job {job.id} never started Ray:\n{job.log()[-3000:]}"
    return found.group(1)


def _processes_with(text: str) -> list[str]:
    """Command lines of live processes that mention `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def _assert_ray_gone(job: Job, address: str) -> None:
    """No process of the job's Ray, no session directory, no address file pointing at it."""
    session = f"/tmp/userrl-ray-{job.id}"
    deadline = time.monotonic() + GONE_S
    while _processes_with(session) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert _processes_with(session) == [], "Ray processes of the job outlived it"
    assert not Path(session).exists(), f"{session} left behind"
    current = Path("/tmp/ray/ray_current_cluster")
    assert not (current.exists() and address in current.read_text()), f"{current} points at the dead cluster"


def _driver_pid(run_name: str) -> int | None:
    """The `userrl train` process of the run (not srun, not the batch shell)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        is_driver = any(a.endswith("/userrl") for a in args[:2]) and "train" in args[1:3]
        if proc.name.isdigit() and is_driver and f"run.name={run_name}" in args:
            return int(proc.name)
    return None


@pytest.fixture(scope="module")
def trained(model: Path, work: Path, jobs: list[Job]) -> tuple[Job, Path]:
    # Ray's stop on the node is waited for 20 s by default (a cancel's SIGKILL follows 30 s after its SIGTERM); here
    # nothing kills it, so a busy node may take as long as it needs to report "Ray stopped".
    stop_waits = {"USERRL_RAY_STOP_WAIT": "600", "USERRL_RAY_STOP_TIMEOUT": "900"}
    job = _submit_train(work, jobs, _train_args(model, work, "two-steps", 2), **stop_waits)
    assert wait_ended(job) == "COMPLETED", job.log()[-5000:]
    return job, work / "runs" / "two-steps"


def test_train_job_trains_and_leaves_no_ray(trained: tuple[Job, Path]) -> None:
    job, run = trained
    assert _steps(run) == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert (run / "checkpoints" / "step_2").is_dir()
    assert "userrl slurm: Ray ready: 1 node(s)" in job.log()
    assert f"Ray stopped, /tmp/userrl-ray-{job.id} removed" in job.log()  # the node's own report, relayed
    _assert_ray_gone(job, _ray_address(job))


def test_cancelled_job_stops_ray_and_resubmission_resumes(model: Path, work: Path, jobs: list[Job]) -> None:
    steps = 3
    run = work / "runs" / "cancelled"
    first = _submit_train(work, jobs, _train_args(model, work, "cancelled", UNREACHED))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not logged_steps(run):
        assert time.monotonic() < deadline, f"no step logged within {RUN_TIMEOUT_S:.0f} s:\n{first.log()[-3000:]}"
        time.sleep(POLL_S)
    # Freeze the driver (somewhere after step 1: it never reaches its total) so the steps read before the cancel
    # are all it logs; Slurm's cancel sends SIGCONT before SIGTERM.
    pid = _driver_pid("cancelled")
    assert pid is not None, "the driver process was not found"
    os.kill(pid, signal.SIGSTOP)
    done_before = logged_steps(run)
    subprocess.run(["scancel", first.id])
    assert wait_ended(first) == "CANCELLED"
    assert done_before == list(range(1, len(done_before) + 1)), done_before
    _assert_ray_gone(first, _ray_address(first))
    assert _driver_pid("cancelled") is None, "the driver outlived its job"
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))

    total = max(steps, saved + 1)  # a step after the resume, however far the first job got
    second = _submit_train(work, jobs, _train_args(model, work, "cancelled", total))
    assert wait_ended(second) == "COMPLETED", second.log()[-5000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{saved}'} at step {saved}" in second.log()
    assert _steps(run) == list(range(1, total + 1))  # every step logged exactly once
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{total}"
    _assert_ray_gone(second, _ray_address(second))


def test_convert_job_exports_the_checkpoint(
    trained: tuple[Job, Path], model: Path, work: Path, jobs: list[Job]
) -> None:
    _, run = trained
    out = work / "hf"
    job = submit(
        "convert.sbatch",
        ["--cpus-per-task=1", "--mem=4G"],  # the default fits Qwen3-32B: more than this machine has
        ["--ckpt", str(run / "checkpoints"), "--out", str(out)],
        work / "out",
        job_env(work / "ray-logs"),
    )
    jobs.append(job)
    assert wait_ended(job) == "COMPLETED", job.log()[-5000:]
    exported, initial = load_file(out / "model.safetensors"), load_file(model / "model.safetensors")
    assert sorted(exported) == sorted(initial)
    for name, tensor in initial.items():
        # Two small optimizer steps move weights by ~1e-3; a wrong mapping would be off by O(1).
        assert exported[name].shape == tensor.shape, name
        assert torch.allclose(exported[name].float(), tensor.float(), atol=2e-2), name


def test_starting_slurm_again_changes_nothing() -> None:
    conf = Path("/etc/slurm/slurm.conf")
    before = conf.stat().st_mtime_ns if conf.exists() else None
    again = subprocess.run(["bash", "tools/slurm_local.sh"], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("slurm_local: already up: node "), again.stdout
    assert (conf.stat().st_mtime_ns if conf.exists() else None) == before


def _readme_sbatch_lines() -> list[list[str]]:
    """The `sbatch ...` command lines of the README, comments cut."""
    lines = (REPO / "README.md").read_text().splitlines()
    return [line.split("#")[0].split() for line in lines if line.startswith("sbatch ")]


def test_readme_one_line_overrides_are_accepted_here() -> None:
    cpu_lines = [c for c in _readme_sbatch_lines() if "--gpus-per-node=0" in c or "slurm/convert.sbatch" in c]
    assert len(cpu_lines) == 2, cpu_lines  # the CPU training line and the conversion line
    for command in cpu_lines:
        tried = subprocess.run(["sbatch", "--test-only", *command[1:]], cwd=REPO, capture_output=True, text=True)
        assert tried.returncode == 0 and " to start at " in tried.stderr, f"{command}: {tried.stderr}"


def test_gpu_default_is_refused_at_submission_without_gpus() -> None:
    gres = subprocess.run(["sinfo", "--noheader", "--format=%G"], capture_output=True, text=True).stdout.split()
    if any("gpu" in g for g in gres):
        pytest.skip(f"this Slurm has GPUs ({gres}): the default request is valid here")
    tried = subprocess.run(
        ["sbatch", "--test-only", "slurm/train.sbatch", "--config", "configs/quickstart.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert tried.returncode == 1
    assert "Invalid generic resource (gres) specification" in tried.stderr  # the README quotes this


def test_missing_environment_fails_at_once(work: Path, jobs: list[Job]) -> None:
    job = _submit_train(work, jobs, ["--config", "configs/quickstart.yaml"], USERRL_VENV=str(work / "no-venv"))
    assert wait_ended(job) == "FAILED"
    assert f"userrl slurm: error: USERRL_VENV={work / 'no-venv'} does not exist" in job.log()
    assert "Ray:" not in job.log()


def test_unknown_network_interface_is_named(work: Path, jobs: list[Job]) -> None:
    job = _submit_train(work, jobs, ["--config", "configs/quickstart.yaml"], USERRL_NET_IF="nosuchif0")
    assert wait_ended(job) == "FAILED"
    assert "USERRL_NET_IF=nosuchif0 has no IPv4 address on" in job.log()
    assert "interfaces here: lo=127.0.0.1/8" in job.log()


def test_a_node_whose_ray_fails_is_reported_with_its_log(work: Path, jobs: list[Job]) -> None:
    job = _submit_train(work, jobs, ["--config", "configs/quickstart.yaml"], USERRL_RAY_CPUS="two")
    assert wait_ended(job) == "FAILED"
    node = re.search(r"Ray: head (\S+) at", job.log()).group(1)
    assert f"userrl slurm: Ray node {node} missing: its Ray step exited with status" in job.log()
    assert "'two' is not a valid integer" in job.log()  # the tail of the node's own log
    assert f"userrl slurm: error: Ray did not start on {node}" in job.log()
    _assert_ray_gone(job, _ray_address(job))
