"""userrl_megatron/cores.py: the cores a process may use follow its affinity (a cpuset, `taskset`), and what the
project starts inside a share keeps to it: torch threads, engine threads, SGLang's CPU thread binding."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.tiny_run import REPO
from userrl_megatron.cores import core_count, cpu_list, split_cores, usable_cores

pinned_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")


def test_cpu_list_writes_runs_as_ranges() -> None:
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2]) == "0-3"
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_split_cores_gives_consecutive_even_shares() -> None:
    assert split_cores([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([4, 6, 5], 1) == [[4, 5, 6]]
    assert split_cores([0, 1], 3) == [[0], [1], [0]]  # fewer cores than parts: one each, shared
    with pytest.raises(ValueError, match=r"^parts must be >= 1, got 0$"):
        split_cores([0], 0)


def test_usable_cores_are_the_affinity_mask() -> None:
    assert usable_cores() == sorted(os.sched_getaffinity(0)) and core_count() == len(usable_cores())


@pinned_only
def test_a_process_pinned_to_one_core_runs_one_thread_everywhere() -> None:
    """A child pinned to its first core (as `taskset -c` or a one-core cpuset would): one core, one engine thread,
    torch's default one thread, and SGLang bound to that core, for each of two TP ranks too."""
    core = usable_cores()[0]
    probe = f"""
import json, os
os.sched_setaffinity(0, {{{core}}})
import torch
from userrl_megatron.config.schema import RolloutConfig
from userrl_megatron.cores import core_count
from userrl_megatron.fleet.pool import engine_threads
from userrl_megatron.fleet.sglang import sglang_env
bind = "SGLANG_CPU_OMP_THREADS_BIND"
threads = [core_count(), engine_threads(RolloutConfig(num_engines=1)), torch.get_num_threads()]
print(json.dumps([*threads, sglang_env("cpu")[bind], sglang_env("cpu", (), 2)[bind]]))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND")}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(done.stdout.splitlines()[-1]) == [1, 1, 1, str(core), f"{core}|{core}"]


def test_a_bind_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from userrl_megatron.fleet.sglang import sglang_env

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-31|32-63")
    assert sglang_env("cpu", (), 2) == {"SGLANG_USE_CPU_ENGINE": "1"}  # the server reads the user's own
