"""The embedded engine's float32 linear layers on CPU through oneDNN (`rollout.embedded.cpu_linear`): the same
logits as torch's own linear to float32 rounding, every linear layer routed, and weights loaded after start-up
read by the next forward."""

from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config import load_config
from userrl_megatron.config.checks import check_config
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.server import onednn
from userrl_megatron.server.model import EngineModel

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear on this CPU")

IDS = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 8, 1, 250, 19, 64]])
POSITIONS = torch.arange(6).expand(2, 6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("onednn") / "m", num_hidden_layers=2)


def logits(engine: EngineModel) -> torch.Tensor:
    with torch.no_grad():
        out = engine.forward(IDS, POSITIONS, cache=None, all_logits=True)
    assert isinstance(out, torch.Tensor)
    return out


def linear_ops(engine: EngineModel) -> dict[str, int]:
    """How many times one forward called each of the two linear operators."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits(engine)
    counts = {e.key: e.count for e in prof.key_averages()}
    return {op: counts.get(op, 0) for op in ("mkldnn::_linear_pointwise", "aten::linear")}


def test_every_linear_layer_runs_through_onednn_with_torchs_numbers(model_dir: Path) -> None:
    fast, plain = EngineModel(model_dir), EngineModel(model_dir, cpu_linear="torch")
    assert (fast.cpu_linear, plain.cpu_linear) == ("onednn", "torch")
    linears = sum(type(m) is torch.nn.Linear for m in fast.model.modules())
    assert linears == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert linear_ops(fast) == {"mkldnn::_linear_pointwise": linears, "aten::linear": 0}
    assert linear_ops(plain) == {"mkldnn::_linear_pointwise": 0, "aten::linear": linears}
    a, b = logits(fast), logits(plain)
    assert a.shape == (2, 6, 256)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_weights_loaded_after_start_up_are_what_the_next_forward_reads(model_dir: Path) -> None:
    fast, plain = EngineModel(model_dir), EngineModel(model_dir, cpu_linear="torch")
    before = logits(fast)
    g = torch.Generator().manual_seed(0)
    update = [
        (
            "model.layers.1.mlp.up_proj.weight",
            torch.randn(fast.model.model.layers[1].mlp.up_proj.weight.shape, generator=g),
        ),
        ("lm_head.weight", torch.randn(fast.model.lm_head.weight.shape, generator=g)),
    ]
    for engine in (fast, plain):
        # received in place (the weight-sync path), as the broadcast writes it
        target = engine.receive_target(update[0][0], torch.float32, tuple(update[0][1].shape), torch.device("cpu"))
        assert target is not None
        target.copy_(update[0][1])
        assert engine.load_weights(update[1:]) == 1
    after = logits(fast)
    assert (after - before).abs().max() > 1.0
    torch.testing.assert_close(after, logits(plain), rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_a_bad_choice(model_dir: Path) -> None:
    assert EngineModel(model_dir, dtype="bfloat16").cpu_linear == "torch"  # torch runs bfloat16 on oneDNN already
    with pytest.raises(ValueError, match=r"^cpu_linear must be one of onednn, torch, got 'mkl'$"):
        EngineModel(model_dir, cpu_linear="mkl")
    with pytest.raises(ConfigError, match=r"^rollout\.embedded\.cpu_linear = 'mkl'; choose from onednn, torch$"):
        check_config(load_config(overrides=["rollout.embedded.cpu_linear=mkl"]))
