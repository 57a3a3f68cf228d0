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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public gym data beside the checkout (../shared/data); tests needing it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public data not found at {SHARED_DATA}")
    return SHARED_DATA
