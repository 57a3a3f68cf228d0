"""Submitting slurm/*.sbatch to a real Slurm from tests: sbatch, wait for the end, read the job's state."""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.tiny_run import REPO, RUN_TIMEOUT_S

# States a job leaves squeue in (besides COMPLETING, which still holds processes).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
POLL_S = 0.5


def slurm_unavailable() -> str | None:
    """Why the Slurm tests cannot run here, or None when a Slurm node is up and accepts jobs."""
    if shutil.which("sbatch") is None:
        return "no Slurm here (no sbatch): run tools/slurm_local.sh as root to start a single-node one"
    status = subprocess.run(["bash", "tools/slurm_local.sh", "status"], cwd=REPO, capture_output=True)
    if status.returncode != 0:
        return "Slurm is installed but no node is up: run tools/slurm_local.sh as root"
    return None


@dataclass
class Job:
    """A submitted batch job and where its output goes."""

    id: str
    output: Path

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


def job_env(logs: Path, **extra: str) -> dict[str, str]:
    """The submitting environment: this interpreter's venv for the job, this checkout first on the path."""
    env = dict(os.environ)
    env.update(USERRL_VENV=sys.prefix, PYTHONPATH=str(REPO), USERRL_RAY_LOGS=str(logs))
    env.update(extra)
    return env


def submit(script: str, sbatch_options: list[str], args: list[str], out_dir: Path, env: dict[str, str]) -> Job:
    """`sbatch [options] slurm/<script> [args]` from the repository root; the job id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = ["sbatch", "--parsable", f"--output={out_dir}/%j.out", *sbatch_options, f"slurm/{script}", *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr}"
    job_id = done.stdout.strip().split(";")[0]
    return Job(job_id, out_dir / f"{job_id}.out")


def state(job: Job) -> str:
    """JobState as scontrol reports it ("" once the record is purged)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job.id], capture_output=True, text=True)
    for field in shown.stdout.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    return ""


def in_queue(job: Job) -> bool:
    """True while the job is pending, running or completing (its processes may still exist)."""
    listed = subprocess.run(["squeue", "--noheader", "--jobs", job.id], capture_output=True, text=True)
    return bool(listed.stdout.strip())


def wait_ended(job: Job, timeout_s: float = RUN_TIMEOUT_S) -> str:
    """Poll until the job has left the queue; its final state (`timeout_s` bounds a hung job only)."""
    deadline = time.monotonic() + timeout_s
    while in_queue(job):
        assert time.monotonic() < deadline, f"job {job.id} still queued after {timeout_s:.0f} s:\n{job.log()[-3000:]}"
        time.sleep(POLL_S)
    final = state(job)
    assert final in ENDED, f"job {job.id}: unexpected state {final!r}"
    return final


def cancel_all(jobs: list[Job]) -> None:
    """scancel whatever of `jobs` is still queued (test teardown)."""
    live = [j.id for j in jobs if in_queue(j)]
    if live:
        subprocess.run(["scancel", *live], check=False)
