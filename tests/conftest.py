"""Shared test fixtures: where the public data lives, and GPU auto-skip."""

import os
from pathlib import Path

import pytest

from userrl_megatron.megatron.cpu import stub_missing_kernels

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("USERRL_SHARED_DATA", REPO.parent / "shared" / "data"))

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
stub_missing_kernels()  # tests import Megatron's modules in this process: megatron.core importable without triton


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group each test for pytest-xdist's `--dist loadgroup` (one worker runs a whole group): by its file, so a
    module fixture is set up once, and the conformance folder as one group, whose engines are package fixtures.
    Without CUDA, skip the tests marked gpu."""
    import torch

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            folder = item.path.parent
            group = folder.name if folder.name == "conformance" else str(item.path.relative_to(REPO))
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread a pytest-xdist worker: the workers already use every core, and more threads than cores
    spin and wait on each other (the unit and conformance folders took 40% more CPU with the default)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public gym data beside the checkout (../shared/data); tests needing it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public data not found at {SHARED_DATA}")
    return SHARED_DATA
