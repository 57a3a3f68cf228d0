"""Gradient accumulation fusion is on only where apex's kernel imports (issue 27, item 3).

megatron-core 0.19.2 builds the output layer as a plain ColumnParallelLinear even under Transformer Engine's spec,
and that layer raises at construction when the fusion is on and `fused_weight_gradient_mlp_cuda` did not import
(`pip install -e .[gpu]` brings TE, not apex). The kernel's presence is tested through the real import system: a
module of that name on sys.path.
"""

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import tiny_config
from userrl_megatron.config import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.model import (
    FUSION_KERNEL,
    gradient_accumulation_fusion,
    transformer_config,
    transformer_fields,
)

ARCH = Architecture.from_hf_config(tiny_config("qwen3").to_dict())
LINE = (
    "gradient accumulation fusion: off, apex's fused_weight_gradient_mlp_cuda kernel is not importable (Megatron's "
    "output layer needs it): weight gradients go to the fp32 main_grad in a separate add (more memory traffic, "
    "same result). To get it, build NVIDIA apex with its CUDA extensions: pip install -v --no-build-isolation "
    '--config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" '
    "git+https://github.com/NVIDIA/apex"
)


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A module named like apex's kernel, importable for the duration of the test."""
    (tmp_path / f"{FUSION_KERNEL}.py").write_text("def wgrad_gemm_accum_fp32(*args):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(FUSION_KERNEL, None)


def test_without_the_kernel_te_is_configured_with_the_fusion_off(caplog: pytest.LogCaptureFixture) -> None:
    assert FUSION_KERNEL not in sys.modules
    with caplog.at_level(logging.WARNING, logger="userrl_megatron.megatron.model"):
        fields = transformer_fields(ARCH, MegatronConfig(), torch.float32, use_te=True)
    assert fields["gradient_accumulation_fusion"] is False
    assert [r.getMessage() for r in caplog.records] == [LINE]


def test_with_the_kernel_te_is_configured_with_the_fusion_on(kernel: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="userrl_megatron.megatron.model"):
        assert gradient_accumulation_fusion(True) is True
        assert transformer_fields(ARCH, MegatronConfig(), torch.float32, use_te=True)["gradient_accumulation_fusion"]
    assert caplog.records == []


def test_the_local_spec_never_fuses(kernel: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="userrl_megatron.megatron.model"):
        assert gradient_accumulation_fusion(False) is False
        assert (
            transformer_config(ARCH, MegatronConfig(), torch.float32, use_te=False).gradient_accumulation_fusion
            is False
        )
    assert caplog.records == []


def test_the_probe_asks_for_the_kernel_megatron_imports() -> None:
    asked: list[str] = []
    assert gradient_accumulation_fusion(True, lambda name: asked.append(name) or False) is False
    assert asked == ["fused_weight_gradient_mlp_cuda"]
