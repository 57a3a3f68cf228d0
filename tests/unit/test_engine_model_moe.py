"""The embedded engine's model on Qwen3-MoE: per-expert checkpoint names load into transformers' fused expert
tensors (and read back), so a full checkpoint pushed by name reproduces the other model's logits exactly."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.convert.hf_io import HFWeights
from userrl_megatron.server.model import EngineModel


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe_engine")
    return make_tiny_model(MOE_FAMILY, root / "a", seed=0), make_tiny_model(MOE_FAMILY, root / "b", seed=1)


def test_checkpoint_names_load_into_fused_experts(models: tuple[Path, Path]) -> None:
    a, b = models
    engine = EngineModel(a)
    weights = HFWeights(b)
    names = list(weights.keys())
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in names  # the checkpoint holds one tensor per expert
    assert engine.load_weights((n, weights[n]) for n in names) == len(names)
    fused = engine.model.model.layers[0].mlp.experts
    assert torch.equal(fused.gate_up_proj[5, :32], weights["model.layers.0.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused.gate_up_proj[5, 32:], weights["model.layers.0.mlp.experts.5.up_proj.weight"])
    assert torch.equal(fused.down_proj[2], weights["model.layers.0.mlp.experts.2.down_proj.weight"])
    got = engine.get_weights_by_name("model.layers.3.mlp.experts.7.up_proj.weight", truncate_size=2)
    assert got == weights["model.layers.3.mlp.experts.7.up_proj.weight"][:2].tolist()
    ids = torch.tensor([[3, 17, 99, 4, 250, 8, 8, 61, 2]])
    want = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()(ids).logits
    got_logits = engine.forward(ids, torch.arange(ids.shape[1])[None], cache=None, all_logits=True)
    assert torch.equal(got_logits, want)


def test_bad_expert_names_and_shapes_are_refused(models: tuple[Path, Path]) -> None:
    engine = EngineModel(models[0])
    with pytest.raises(KeyError, match=r"unknown parameter 'model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight'"):
        engine.load_weights([("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight: shape \(32, 64\) does not match \(64, 32\)"):
        engine.load_weights([("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(32, 64))])
    assert engine.get_weights_by_name("model.layers.0.mlp.experts.9.down_proj.weight") is None


def test_an_expert_projection_is_received_into_its_view_of_the_fused_tensor(models: tuple[Path, Path]) -> None:
    engine = EngineModel(models[0])
    fused = engine.model.model.layers[0].mlp.experts
    cpu = torch.device("cpu")
    up = engine.receive_target("model.layers.0.mlp.experts.5.up_proj.weight", torch.float32, (32, 64), cpu)
    assert up is not None and up.data_ptr() == fused.gate_up_proj[5, 32:].data_ptr()
    down = engine.receive_target("model.layers.0.mlp.experts.2.down_proj.weight", torch.float32, (64, 32), cpu)
    assert down is not None and down.data_ptr() == fused.down_proj[2].data_ptr()
    assert engine.receive_target("model.layers.0.mlp.experts.8.gate_proj.weight", torch.float32, (32, 64), cpu) is None
