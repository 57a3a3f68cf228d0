"""The job's host memory limit (Slurm's variables, cgroup v1 and v2 files, all faked) and the start-up check that
refuses a plan pinning more on a node than that limit."""

from pathlib import Path

import pytest

from userrl_megatron.config import RootConfig, load_config
from userrl_megatron.errors import UserError
from userrl_megatron.memory_limit import (
    GIB,
    MemoryLimit,
    cgroup_limit,
    check_host_memory,
    host_memory_problem,
    job_memory_limit,
    slurm_limit,
)
from userrl_megatron.plan.planner import HostRow, MemoryPlan

V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for no limit


def _proc(tmp_path: Path, cgroup: str, mountinfo: list[str]) -> Path:
    """A fake /proc/self: its `cgroup` and `mountinfo` files."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return proc


def _limits(root: Path, name: str, limits: dict[str, str]) -> None:
    """Write file `name` with each value into cgroup directory `root`/path."""
    for path, value in limits.items():
        folder = root / path
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(value + "\n")


def _v1(tmp_path: Path, path: str, limits: dict[str, str]) -> Path:
    """A cgroup v1 host (hybrid, as Debian's with Slurm's cgroup/v1): the memory controller on its own hierarchy."""
    memory = tmp_path / "sys/fs/cgroup/memory"
    _limits(memory, "memory.limit_in_bytes", limits)
    return _proc(
        tmp_path,
        f"9:name=systemd:/\n4:memory:{path}\n3:cpuset:/\n0::/\n",
        [
            "22 1 0:20 / /sys rw,nosuid shared:7 - sysfs sysfs rw",
            f"30 25 0:26 / {memory} rw,relatime - cgroup cgroup rw,memory",
            f"31 25 0:27 / {tmp_path}/sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset",
            f"32 25 0:28 / {tmp_path}/sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
        ],
    )


def _v2(tmp_path: Path, path: str, limits: dict[str, str], mount_root: str = "/") -> Path:
    """A cgroup v2 host: one hierarchy mounted at /sys/fs/cgroup (`mount_root`: the part of it a container sees)."""
    unified = tmp_path / "sys/fs/cgroup"
    _limits(unified, "memory.max", limits)
    return _proc(
        tmp_path,
        f"0::{path}\n",
        [f"35 24 0:30 {mount_root} {unified} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot"],
    )


# Slurm's variables


def test_no_slurm_job_no_limit() -> None:
    assert slurm_limit({"SLURM_MEM_PER_NODE": "4096"}) is None  # left over outside a job: not this process's


def test_mem_per_node_is_mib() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_MEM_PER_NODE": "4096"}
    assert slurm_limit(env) == MemoryLimit(4 * GIB, "SLURM_MEM_PER_NODE=4096 MiB")


def test_mem_per_cpu_times_the_nodes_cpus() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_MEM_PER_CPU": "1024", "SLURM_CPUS_ON_NODE": "32"}
    assert slurm_limit(env) == MemoryLimit(32 * GIB, "SLURM_MEM_PER_CPU=1024 MiB x 32 CPUs")


def test_a_job_without_a_memory_request_has_no_slurm_limit() -> None:
    # --mem=0 (the whole node) sets no variable; the cgroup then holds the node's memory.
    assert slurm_limit({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "32"}) is None
    assert slurm_limit({"SLURM_JOB_ID": "7", "SLURM_MEM_PER_NODE": "0"}) is None


# cgroup files


def test_v1_the_smallest_limit_of_the_cgroup_and_those_above_it(tmp_path: Path) -> None:
    # What Slurm's task/cgroup makes of `--mem=2G` (tools/slurm_local.sh): the step and the job limited, the task not.
    job = "slurm_vm/uid_0/job_11"
    limits = {"": V1_UNLIMITED, job: str(2 * GIB), f"{job}/step_1": str(3 * GIB), f"{job}/step_1/task_0": V1_UNLIMITED}
    proc = _v1(tmp_path, f"/{job}/step_1/task_0", limits)
    found = cgroup_limit(proc)
    assert found == MemoryLimit(2 * GIB, f"cgroup {tmp_path}/sys/fs/cgroup/memory/{job}/memory.limit_in_bytes")


def test_v1_unlimited_everywhere_is_no_limit(tmp_path: Path) -> None:
    proc = _v1(tmp_path, "/process_api/da27", {"": V1_UNLIMITED, "process_api/da27": V1_UNLIMITED})
    assert cgroup_limit(proc) is None


def test_v2_memory_max_up_to_the_mount(tmp_path: Path) -> None:
    limits = {"system.slice": "max", "system.slice/job_3": str(8 * GIB), "system.slice/job_3/step_0": "max"}
    proc = _v2(tmp_path, "/system.slice/job_3/step_0", limits)
    assert cgroup_limit(proc) == MemoryLimit(8 * GIB, f"cgroup {tmp_path}/sys/fs/cgroup/system.slice/job_3/memory.max")


def test_v2_inside_a_container_that_sees_part_of_the_hierarchy(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup names the full path, the mount shows it from /docker/abc down.
    proc = _v2(tmp_path, "/docker/abc", {"": str(16 * GIB)}, mount_root="/docker/abc")
    assert cgroup_limit(proc) == MemoryLimit(16 * GIB, f"cgroup {tmp_path}/sys/fs/cgroup/memory.max")


def test_no_cgroup_files_no_limit(tmp_path: Path) -> None:
    assert cgroup_limit(tmp_path / "no-proc") is None
    assert cgroup_limit(_v2(tmp_path, "/user.slice", {})) is None  # no memory.max: the controller is not enabled


def test_the_smaller_of_slurm_and_the_cgroup(tmp_path: Path) -> None:
    proc = _v2(tmp_path, "/job", {"job": str(6 * GIB)})
    env = {"SLURM_JOB_ID": "7", "SLURM_MEM_PER_NODE": "4096"}
    assert job_memory_limit(env, proc) == MemoryLimit(4 * GIB, "SLURM_MEM_PER_NODE=4096 MiB")
    assert job_memory_limit({}, proc) == MemoryLimit(6 * GIB, f"cgroup {tmp_path}/sys/fs/cgroup/job/memory.max")
    assert job_memory_limit({}, tmp_path / "no-proc") is None


# The refusal


def _row(node: int, **held_gib: float) -> HostRow:
    held = {label.replace("_", " "): int(gib * GIB) for label, gib in held_gib.items()}
    return HostRow(node, sum(held.values()), held, actor_ranks=8, engine_gpus=8)


def test_a_plan_that_fits_passes() -> None:
    limit = MemoryLimit(500 * GIB, "SLURM_MEM_PER_NODE=512000 MiB")
    assert host_memory_problem([_row(0, offload=246, checkpoint_staging=238.1)], limit) is None
    assert host_memory_problem([], limit) is None


def test_a_plan_over_the_limit_names_both_figures_what_holds_it_and_the_fix() -> None:
    rows = [_row(0, offload=100), _row(1, offload=246, checkpoint_staging=238.1)]
    problem = host_memory_problem(rows, MemoryLimit(400 * GIB, "SLURM_MEM_PER_NODE=409600 MiB"))
    assert problem == (
        "host memory: the plan pins 484.1 GiB on node 1 (offload 246.0 GiB (megatron.offload), checkpoint staging "
        "238.1 GiB (checkpoint.save_optimizer); `userrl plan`), more than the 400.0 GiB this job may use on a node "
        "(SLURM_MEM_PER_NODE=409600 MiB): ask for at least --mem=485G per node plus the processes' own memory "
        '(--mem=0: the whole node), or turn down what holds it (docs/plan.md, "Host memory")'
    )


def _plan(*rows: HostRow) -> MemoryPlan:
    return MemoryPlan(80 * GIB, 8, [], [], 0, [], host=list(rows))


@pytest.fixture
def cfg() -> RootConfig:
    return load_config([str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")], [])


def test_no_limit_plans_nothing(cfg: RootConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(_: object) -> MemoryPlan:
        raise AssertionError("planned without a limit")

    monkeypatch.setattr("userrl_megatron.plan.plan_run", never)
    check_host_memory(cfg, env={}, proc=tmp_path / "no-proc")


def test_the_check_refuses_a_plan_over_the_jobs_limit(
    cfg: RootConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("userrl_megatron.plan.plan_run", lambda _: _plan(_row(0, KL_reference=3)))
    env = {"SLURM_JOB_ID": "7", "SLURM_MEM_PER_NODE": "2048"}
    with pytest.raises(UserError, match=r"pins 3.0 GiB on node 0 .* more than the 2.0 GiB this job may use on a node"):
        check_host_memory(cfg, env=env, proc=tmp_path / "no-proc")
    check_host_memory(cfg, env={**env, "SLURM_MEM_PER_NODE": "4096"}, proc=tmp_path / "no-proc")  # fits


def test_a_config_the_planner_cannot_plan_is_not_refused_here(
    cfg: RootConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_shape(_: object) -> MemoryPlan:
        raise UserError("model.path = x: no config.json there")

    monkeypatch.setattr("userrl_megatron.plan.plan_run", no_shape)
    check_host_memory(cfg, env={"SLURM_JOB_ID": "7", "SLURM_MEM_PER_NODE": "2048"}, proc=tmp_path / "no-proc")
    assert "host memory not checked against the job's 2.0 GiB (SLURM_MEM_PER_NODE=2048 MiB)" in caplog.text
