"""The host memory a job may use on a node, and the start-up check that refuses a run whose plan needs more.

Slurm gives a job `--mem` per node (`SLURM_MEM_PER_NODE`, MiB) or `--mem-per-cpu` (`SLURM_MEM_PER_CPU` x the
node's CPUs). With task/cgroup, or in a container, the kernel enforces a cgroup limit on this process and every
cgroup above it (`memory.max` in cgroup v2, `memory.limit_in_bytes` in v1). The smallest of these is what a node of
the run may hold. `userrl plan` counts each node's pinned host memory (offload, the KL reference, checkpoint staging,
the engines' backups); a node that reaches the limit is killed by the OOM killer, or its workers by Ray's memory
monitor, hours into the run. `check_host_memory` refuses such a run at start-up, before any process starts.
"""

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from userrl_megatron.config.schema import RootConfig
from userrl_megatron.errors import UserError

if TYPE_CHECKING:  # the planner imports torch: only `check_host_memory` needs it, once a limit is found
    from userrl_megatron.plan.planner import HostRow

GIB = 2**30
MIB = 2**20
# cgroup v1 reports "no limit" as its largest page count in bytes (9223372036854771712); v2 writes "max".
UNLIMITED = 2**60
# What each holder of pinned host memory in the plan comes from, to name what turns it down.
KNOBS = {
    "offload": "megatron.offload",
    "KL reference": "algo.kl_coef",
    "checkpoint staging": "checkpoint.save_optimizer",
    "engine weight backup": "rollout.sglang.enable_weights_cpu_backup",
    "engine CUDA graph backup": "rollout.sglang.release_cuda_graph",
}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryLimit:
    """A limit on the memory of this node's share of the job, in bytes, and where it was read."""

    bytes: int
    source: str


def slurm_limit(env: Mapping[str, str]) -> MemoryLimit | None:
    """The memory Slurm allocated to the job on this node (`--mem` or `--mem-per-cpu`), or None outside a job or
    without one (`--mem=0` sets neither: the cgroup then holds the node's memory)."""
    if not env.get("SLURM_JOB_ID"):
        return None
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return MemoryLimit(int(per_node) * MIB, f"SLURM_MEM_PER_NODE={per_node} MiB")
    per_cpu, cpus = env.get("SLURM_MEM_PER_CPU", ""), env.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and int(per_cpu) > 0 and cpus.isdigit() and int(cpus) > 0:
        return MemoryLimit(int(per_cpu) * int(cpus) * MIB, f"SLURM_MEM_PER_CPU={per_cpu} MiB x {cpus} CPUs")
    return None


def cgroup_limit(proc: Path = Path("/proc/self")) -> MemoryLimit | None:
    """The smallest memory limit of this process's cgroup and the cgroups above it (v2 `memory.max`, v1 the memory
    controller's `memory.limit_in_bytes`), found through `proc`/cgroup and `proc`/mountinfo; None without one."""
    try:
        groups = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: list[MemoryLimit] = []
    for line in groups:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found += _walk(_mounts(mounts, "cgroup2", None), path, "memory.max")
        elif "memory" in controllers.split(","):
            found += _walk(_mounts(mounts, "cgroup", "memory"), path, "memory.limit_in_bytes")
    return min(found, key=lambda limit: limit.bytes, default=None)


def job_memory_limit(env: Mapping[str, str] = os.environ, proc: Path = Path("/proc/self")) -> MemoryLimit | None:
    """The smallest of Slurm's allocation and the cgroup limits of this process; None when neither is set."""
    limits = [limit for limit in (slurm_limit(env), cgroup_limit(proc)) if limit is not None]
    return min(limits, key=lambda limit: limit.bytes, default=None)


def host_memory_problem(host: "list[HostRow]", limit: MemoryLimit) -> str | None:
    """One line naming the node whose planned pinned memory exceeds `limit`, both figures and the fix; None when
    every node fits."""
    if not host:
        return None
    node = max(host, key=lambda row: row.used)
    if node.used <= limit.bytes:
        return None
    held = ", ".join(
        f"{label} {nbytes / GIB:.1f} GiB" + (f" ({KNOBS[label]})" if label in KNOBS else "")
        for label, nbytes in sorted(node.held.items(), key=lambda kv: -kv[1])
        if nbytes
    )
    return (
        f"host memory: the plan pins {node.used / GIB:.1f} GiB on node {node.node} ({held}; `userrl plan`), more "
        f"than the {limit.bytes / GIB:.1f} GiB this job may use on a node ({limit.source}): ask for at least "
        f"--mem={math.ceil(node.used / GIB)}G per node plus the processes' own memory (--mem=0: the whole node), "
        'or turn down what holds it (docs/plan.md, "Host memory")'
    )


def check_host_memory(cfg: RootConfig, env: Mapping[str, str] = os.environ, proc: Path = Path("/proc/self")) -> None:
    """Raise UserError when the plan's pinned host memory of a node exceeds the job's limit; nothing to check (no
    planning either) when no limit is set."""
    limit = job_memory_limit(env, proc)
    if limit is None:
        return
    from userrl_megatron.plan import plan_run

    try:
        plan = plan_run(cfg)
    except UserError as e:  # no model shape to plan with: the run reports what it lacks itself
        log.warning("host memory not checked against the job's %.1f GiB (%s): %s", limit.bytes / GIB, limit.source, e)
        return
    problem = host_memory_problem(plan.host, limit)
    if problem:
        raise UserError(problem)


def _mounts(mountinfo: list[str], fstype: str, option: str | None) -> list[tuple[str, Path]]:
    """(root within the hierarchy, mount point) of each mount of `fstype` (with `option` among its super options)."""
    out = []
    for line in mountinfo:
        fields, _, tail = line.partition(" - ")
        parts, extra = fields.split(), tail.split()
        if len(parts) < 5 or len(extra) < 3 or extra[0] != fstype:
            continue
        if option is None or option in extra[2].split(","):
            out.append((_unescape(parts[3]), Path(_unescape(parts[4]))))
    return out


def _walk(mounts: list[tuple[str, Path]], path: str, name: str) -> list[MemoryLimit]:
    """The limits in file `name` of cgroup `path` and every cgroup above it, on the first mount that shows it."""
    for root, mountpoint in mounts:
        if root != "/" and path != root and not path.startswith(root.rstrip("/") + "/"):
            continue
        here = mountpoint / path[len(root.rstrip("/")) :].lstrip("/")
        if not here.is_dir():
            continue
        limits = []
        for directory in [here, *here.parents]:
            limit = _read_limit(directory / name)
            if limit is not None:
                limits.append(MemoryLimit(limit, f"cgroup {directory / name}"))
            if directory == mountpoint:
                break
        return limits
    return []


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < UNLIMITED else None


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (space, tab, newline, backslash) decoded."""
    return field.encode().decode("unicode_escape") if "\\" in field else field
