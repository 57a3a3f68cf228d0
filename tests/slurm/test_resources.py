"""The job's CPUs and memory under a real Slurm that binds tasks to cores and books memory (`tools/slurm_local.sh`).

Every `srun` step of slurm/*.sbatch, and a Ray worker of the job, runs on as many CPUs as the job's `--cpus-per-task`
(since Slurm 22.05 srun does not pass them on by itself). A job asking for less `--mem` than the plan pins on a node
stops at start-up with one line naming both figures; where Slurm's cgroups enforce memory, the same refusal comes from
the cgroup's limit alone. The steps are observed through `USERRL_CONTAINER`, the scripts' command prefix: here a
wrapper that reports its CPUs (and, in place of the driver, a Ray task's) or hides Slurm's memory variables.
Skipped, with the reason, where no Slurm node is up or where this Slurm binds no task to cores or enforces no memory.
"""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.slurm import Job, cancel_all, job_env, slurm_unavailable, submit, wait_ended
from tests.support.tiny_run import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_why_not = slurm_unavailable()
if _why_not:
    pytest.skip(_why_not, allow_module_level=True)

GIB = 2**30
CPUS = 2  # the job's CPUs per task: more than the one a step gets when srun is not told
JOB_S = 900.0  # a bound on a hung job: these start Ray and stop at the driver's first check
MEMORY = "2G"  # room for Ray's head and the driver, far below what the planned config pins on a node
PLANNED = ["--config", str(REPO / "configs/quickstart.yaml"), "model.path=qwen3-4b"]  # KL reference + staging

# Reports the CPUs of every command it prefixes; in place of the driver (`userrl train`), the CPUs of a task that
# the job's Ray runs on one of its workers; in place of `userrl convert`, nothing more.
CORES_PREFIX = r"""#!/usr/bin/env bash
set -euo pipefail
cores() { python -c 'import os; print(len(os.sched_getaffinity(0)))'; }
echo "probe: $(cores) CPUs for: $*" >&2  # stderr: `ray_node.sh ip`'s stdout is the head's address
case "${1:-} ${2:-}" in
  "userrl train")
    python - <<'EOF'
import os, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
cores = ray.remote(num_cpus=1)(lambda: len(os.sched_getaffinity(0)))
print(f"probe: a Ray task of the job runs on {ray.get(cores.remote())} CPUs", flush=True)
EOF
    exit 0 ;;
  "userrl convert") exit 0 ;;
esac
exec "$@"
"""
# The job's limit as a cgroup alone: Slurm's memory variables hidden from the command.
CGROUP_ONLY_PREFIX = """#!/usr/bin/env bash
exec env -u SLURM_MEM_PER_NODE -u SLURM_MEM_PER_CPU "$@"
"""


def _config() -> dict[str, str]:
    """`scontrol show config` as {name: value}."""
    shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    pairs = (line.split("=", 1) for line in shown.splitlines() if " = " in line)
    return {name.strip(): value.strip() for name, value in pairs}


def _no_core_binding() -> str | None:
    """Why a step here would see every CPU whatever it asked for, or None when tasks are bound to what they ask."""
    conf = _config()
    plugins, param = conf.get("TaskPlugin", ""), conf.get("TaskPluginParam", "")
    if "task/affinity" not in plugins and "task/cgroup" not in plugins:
        return f"this Slurm binds no task to CPUs (TaskPlugin={plugins}): restart it with tools/slurm_local.sh"
    if "cores" not in param.lower() and "threads" not in param.lower():
        return (
            f"this Slurm gives a step every CPU of the job unless it asks for fewer (TaskPluginParam={param or 'none'})"
            ": tools/slurm_local.sh binds tasks to cores"
        )
    if len(os.sched_getaffinity(0)) < CPUS:
        return f"needs {CPUS} cores to tell the job's CPUs from the one a step gets by default"
    return None


def _no_cgroup_memory() -> str | None:
    """Why Slurm's cgroups enforce no memory limit here, or None when they do."""
    conf = _config()
    if "task/cgroup" not in conf.get("TaskPlugin", "") or conf.get("ConstrainRAMSpace", "").lower() != "yes":
        return (
            f"Slurm enforces no memory limit here (TaskPlugin={conf.get('TaskPlugin')}, ConstrainRAMSpace="
            f"{conf.get('ConstrainRAMSpace', 'unset')}): tools/slurm_local.sh needs writable cgroup v1 memory, cpuset"
            " and freezer hierarchies"
        )
    return None


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slurm-resources")


@pytest.fixture(scope="module")
def jobs() -> Iterator[list[Job]]:
    submitted: list[Job] = []
    yield submitted
    cancel_all(submitted)


def _prefix(work: Path, name: str, text: str) -> str:
    path = work / name
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _planned_gib() -> float:
    """The pinned host memory the plan gives the busiest node of the refused config."""
    from userrl_megatron.config import load_config
    from userrl_megatron.plan import plan_run

    cfg = load_config([PLANNED[1]], PLANNED[2:])
    return max(row.used for row in plan_run(cfg).host) / GIB


def test_every_step_and_ray_worker_gets_the_jobs_cpus(work: Path, jobs: list[Job]) -> None:
    why = _no_core_binding()
    if why:
        pytest.skip(why)
    env = job_env(work / "ray-logs", USERRL_CONTAINER=_prefix(work, "cores.sh", CORES_PREFIX))
    cpus = [f"--cpus-per-task={CPUS}"]
    train = submit("train.sbatch", ["--nodes=1", "--gpus-per-node=0", *cpus], PLANNED, work / "out", env)
    jobs.append(train)
    assert wait_ended(train, JOB_S) == "COMPLETED", train.log()[-5000:]
    convert_args = ["--ckpt", str(work), "--out", str(work / "hf")]
    convert = submit("convert.sbatch", [*cpus, "--mem=1G"], convert_args, work / "out", env)
    jobs.append(convert)
    assert wait_ended(convert, JOB_S) == "COMPLETED", convert.log()[-5000:]

    ray_log = next((work / "ray-logs" / train.id).glob("ray-*.log")).read_text()
    assert f"probe: {CPUS} CPUs for: bash slurm/ray_node.sh head" in ray_log, ray_log[-3000:]
    assert f"probe: {CPUS} CPUs for: userrl train" in train.log(), train.log()[-3000:]
    assert f"probe: a Ray task of the job runs on {CPUS} CPUs" in train.log(), train.log()[-3000:]
    assert f"probe: {CPUS} CPUs for: userrl convert mcore2hf" in convert.log(), convert.log()[-3000:]


@pytest.mark.parametrize("limit", ["SLURM_MEM_PER_NODE", "cgroup"])
def test_too_little_memory_is_refused_at_start_up(limit: str, work: Path, jobs: list[Job]) -> None:
    extra = {}
    if limit == "cgroup":
        why = _no_cgroup_memory()
        if why:
            pytest.skip(why)
        extra["USERRL_CONTAINER"] = _prefix(work, "cgroup-only.sh", CGROUP_ONLY_PREFIX)
    args = [*PLANNED, f"run.output_dir={work / 'runs'}", f"run.name=memory-{limit}"]
    options = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={CPUS}", f"--mem={MEMORY}"]
    job = submit("train.sbatch", options, args, work / "out", job_env(work / "ray-logs", **extra))
    jobs.append(job)
    assert wait_ended(job, JOB_S) == "FAILED", job.log()[-5000:]

    source = "SLURM_MEM_PER_NODE=2048 MiB" if limit == "SLURM_MEM_PER_NODE" else "cgroup /sys/fs/cgroup/"
    refusal = (
        f"userrl: error: host memory: the plan pins {_planned_gib():.1f} GiB on node 0 (KL reference",
        f"more than the 2.0 GiB this job may use on a node ({source}",
    )
    assert all(part in job.log() for part in refusal), job.log()[-5000:]
    assert "ask for at least --mem=" in job.log()
    assert not (work / "runs" / f"memory-{limit}" / "run.log").exists(), "the run started before the check"
    assert "Ray stopped" in job.log()
