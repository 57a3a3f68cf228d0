"""The CPU cores this process may run on: its affinity mask, which a SLURM or container cpuset (and `taskset`)
narrows, not every core of the machine (`os.cpu_count()`). Thread counts and SGLang's CPU thread binding come
from here, so processes started inside a share of the machine keep to that share instead of running more
threads than it has cores (every torch thread then waits on the slowest, descheduled one)."""

import os
from collections.abc import Sequence


def usable_cores() -> list[int]:
    """The ids of the cores this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_count() -> int:
    """How many cores this process may run on (at least 1)."""
    return max(1, len(usable_cores()))


def cpu_list(cores: Sequence[int]) -> str:
    """`cores` as a Linux CPU list, runs of consecutive ids as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_cores(cores: Sequence[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` consecutive shares as even as possible; with fewer cores than parts, the parts share
    them round robin (one core each)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    ordered = sorted(cores)
    if len(ordered) < parts:
        return [[ordered[i % len(ordered)]] for i in range(parts)]
    size, extra = divmod(len(ordered), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        shares.append(ordered[start:end])
        start = end
    return shares
