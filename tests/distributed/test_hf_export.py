"""The HF export of a pipeline-parallel actor: each stage writes its own shards and global rank 0 only names them
and writes the index, so no rank holds more than about one shard of tensors, never the whole model."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.distributed import build_actor, init_world, megatron_config, spawn
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import AlgoConfig, ModelConfig
from userrl_megatron.convert.hf_io import INDEX_FILE, HFWeights

pytestmark = pytest.mark.distributed
SHARD = 96 * 1024


def _export(rank: int, world: int, port: int, model_dir: Path, out: Path) -> int:
    cfg = megatron_config(pp=2)
    init_world(rank, world, port, cfg)
    return build_actor(model_dir, cfg).export_hf_dir(str(out), max_shard_bytes=SHARD)


def test_each_stage_writes_its_shards_and_no_rank_holds_the_model(tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=4, num_hidden_layers=4)
    out = tmp_path / "export"
    peaks = spawn(_export, 2, model_dir, out)
    original = HFWeights(model_dir)
    sizes = {n: original[n].numel() * original[n].element_size() for n in original.keys()}  # noqa: SIM118
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 2
    assert index["weight_map"].keys() == sizes.keys() and index["metadata"]["total_size"] == sum(sizes.values())
    exported = HFWeights(out)
    assert all(torch.equal(exported[n], original[n]) for n in sizes)
    # both stages wrote: the first layer and the final norm sit in different files
    assert index["weight_map"]["model.layers.0.mlp.up_proj.weight"] != index["weight_map"]["model.norm.weight"]
    assert all(0 < peak <= max(SHARD, max(sizes.values())) for peak in peaks), peaks
    assert sum(sizes.values()) > 4 * max(peaks)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert torch.equal(a, b)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no staging directory left


def _bf16_export(rank: int, world: int, port: int, model_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Every parameter's dtype, and how each exported tensor differs from the checkpoint rounded to bf16."""
    from userrl_megatron.megatron.actor import MegatronActor

    cfg = megatron_config()
    init_world(rank, world, port, cfg)
    actor = MegatronActor(ModelConfig(path=str(model_dir), dtype="bfloat16"), cfg, AlgoConfig(), 0)
    dtypes = {n: str(p.dtype) for c in actor.chunks for n, p in c.module.named_parameters()}
    original = HFWeights(model_dir)
    verdicts = {}
    for name, tensor in actor.export_hf_weights():
        same = tensor.dtype == torch.bfloat16 and torch.equal(tensor, original[name].to(torch.bfloat16))
        verdicts[name] = "equal" if same else f"{tensor.dtype}, not the checkpoint in bf16"
    return dtypes, verdicts


def test_a_bf16_actor_holds_and_exports_every_tensor_in_bf16(tmp_path: Path) -> None:
    """Megatron's local spec makes its torch norms in fp32; the actor casts them, so the engine (which loads the
    checkpoint in bf16) receives exactly the numbers the actor trains."""
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", seed=4)
    [(dtypes, verdicts)] = spawn(_bf16_export, 1, model_dir)
    assert set(dtypes.values()) == {"torch.bfloat16"}, dtypes
    assert any("layernorm" in n for n in dtypes)
    assert set(verdicts) == set(HFWeights(model_dir).keys())
    assert {n: v for n, v in verdicts.items() if v != "equal"} == {}
