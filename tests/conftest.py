"""Shared test fixtures and hooks: where the public data lives, GPU auto-skip, and how pytest-xdist workers split the
tests (whole files, longest first) and the cores (a share each)."""

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from userrl_megatron.fleet.placement import ray_environment
from userrl_megatron.megatron.cpu import stub_missing_kernels

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("USERRL_SHARED_DATA", REPO.parent / "shared" / "data"))
DURATIONS = Path(__file__).with_name("durations.json")  # seconds per group, from `pytest --record-durations`
UNKNOWN_SLOW_S = 120.0  # a group not in DURATIONS holding a slow test: handed out among the long ones

os.environ.setdefault("WANDB_SILENT", "true")
ray_environment()  # the Ray instances tests start themselves get what the project's own do
stub_missing_kernels()  # tests import Megatron's modules in this process: megatron.core importable without triton


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group each test for pytest-xdist's `--dist loadgroup` (one worker runs a whole group): by its file, so a
    module fixture is set up once, and the conformance folder as one group, whose engines are package fixtures.
    Groups go longest first (their recorded durations), so that the last ones handed out are short and the
    workers end together (run with `--no-loadscope-reorder`, which keeps this order). Without CUDA, skip the tests
    marked gpu."""
    import torch

    groups: dict[pytest.Item, str] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is None:
            folder = item.path.parent
            group = folder.name if folder.name == "conformance" else str(item.path.relative_to(REPO))
            item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = mark.args[0] if mark is not None else group
    slow = {groups[item] for item in items if "slow" in item.keywords}
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def expected(group: str) -> float:
        return recorded.get(group, UNKNOWN_SLOW_S if group in slow else 0.0)

    items.sort(key=lambda item: -expected(groups[item]))  # stable: each group keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"write each group's run time (seconds, setup to teardown) to {DURATIONS.relative_to(REPO)}; groups "
        "that did not run keep theirs",
    )


_group_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add a test phase's time to its group's (pytest-xdist names a grouped test `<nodeid>@<group>`)."""
    if "@" in report.nodeid:
        _group_seconds[report.nodeid.rsplit("@", 1)[1]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput"):
        recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        recorded.update({group: round(seconds, 1) for group, seconds in _group_seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker keeps to its share of the cores (worker i of n: the i-th of n consecutive shares),
    and so does everything it starts (servers, ranks, Ray), whose thread counts follow the cores they may use
    (`userrl_megatron.cores`). Without shares, two workers' processes each ran a thread a core: twice as many
    threads as cores, each torch operation waiting for a descheduled thread (up to 15x slower)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    import torch

    from userrl_megatron.cores import split_cores, usable_cores

    cores = usable_cores()
    if len(cores) >= count:
        share = split_cores(cores, count)[int(worker.removeprefix("gw"))]
        for thread in os.listdir("/proc/self/task"):  # every thread: a new one inherits its creator's cores
            os.sched_setaffinity(int(thread), share)
    torch.set_num_threads(max(1, len(cores) // count))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public gym data beside the checkout (../shared/data); tests needing it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public data not found at {SHARED_DATA}")
    return SHARED_DATA
