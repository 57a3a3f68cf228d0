"""The embedded engine and the actor's local attention call SDPA with cuDNN's backend off: cuDNN builds a graph
for every new shape (59 ms a decode step on an H200, docs/gpu.md), and both change shape nearly every call."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.attention_backends import SDPA_BACKENDS


@pytest.fixture
def cudnn_flags(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether cuDNN attention was allowed at each SDPA call."""
    flags: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        flags.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return flags


def test_the_backends_are_every_one_but_cudnn() -> None:
    assert SDPBackend.CUDNN_ATTENTION not in SDPA_BACKENDS
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(SDPA_BACKENDS)


def test_the_engine_runs_attention_without_cudnn(tmp_path: Path, cudnn_flags: list[bool]) -> None:
    from userrl_megatron.server.model import EngineModel

    engine = EngineModel(make_tiny_model("qwen3", tmp_path / "m", num_hidden_layers=2))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default, outside the engine's forward
    logits = engine.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), None)
    assert logits.shape == (1, 256) and cudnn_flags == [False, False]  # one call per layer
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored


def test_the_actors_local_attention_runs_without_cudnn(cudnn_flags: list[bool]) -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from userrl_megatron.megatron.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, attention_dropout=0.0
    )
    tp_of_one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=tp_of_one)  # type: ignore[arg-type]
    q, kv = torch.randn(5, 1, 4, 16), torch.randn(5, 1, 2, 16)
    assert attention(q, kv, kv, None).shape == (5, 1, 64) and cudnn_flags == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()
