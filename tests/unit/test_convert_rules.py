"""HF <-> Megatron conversion rules, tensor-parallel sharding and vocabulary padding (pure torch)."""

import dataclasses
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import FAMILIES, randomize_norms_and_biases, tiny_config
from userrl_megatron.convert import (
    FAMILY_RULES,
    Architecture,
    Converter,
    Split,
    UnsupportedModelError,
    padded_vocab_size,
    shard,
    unshard,
)
from userrl_megatron.convert.rules import GATE_UP, QKV


def hf_state(family: str, **overrides: object) -> tuple[Architecture, dict[str, torch.Tensor]]:
    config = tiny_config(family, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms_and_biases(model)
    return Architecture.from_hf_config(config.to_dict()), model.state_dict()


def tiny_arch(**changes: object) -> Architecture:
    base = Architecture.from_hf_config(tiny_config("qwen2").to_dict())
    return dataclasses.replace(base, **changes)


def test_architecture_reads_each_family() -> None:
    llama = Architecture.from_hf_config(tiny_config("llama", tie_word_embeddings=True).to_dict())
    qwen2 = Architecture.from_hf_config(tiny_config("qwen2").to_dict())
    qwen3 = Architecture.from_hf_config(tiny_config("qwen3", head_dim=32).to_dict())
    assert (llama.family, llama.qkv_bias, llama.qk_norm, llama.tied_embeddings) == ("llama", False, False, True)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.rope_theta) == (True, False, 1e6)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.heads_per_group) == (False, True, 32, 2)
    assert llama.rope_theta == 10000.0 and llama.norm_eps == 1e-6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_transformers(family: str, tied: bool) -> None:
    config = tiny_config(family, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert Architecture.from_hf_config(config.to_dict()).num_parameters == sum(p.numel() for p in model.parameters())


def test_unsupported_models_fail_by_name() -> None:
    cases = {
        "mistral": ("model_type 'mistral' is not supported", {"model_type": "mistral"}),
        "act": ("hidden_act 'gelu' is not supported", {"hidden_act": "gelu"}),
        "rope": ("rope_type 'yarn' is not supported", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}),
        "bias": ("llama: attention_bias = true (q/k/v/o biases) is not supported", {"attention_bias": True}),
        "gqa": ("num_attention_heads 4 is not a multiple of num_key_value_heads 3", {"num_key_value_heads": 3}),
    }
    for expected, changes in cases.values():
        config = {**tiny_config("llama").to_dict(), **changes}
        with pytest.raises(UnsupportedModelError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            Architecture.from_hf_config(config)


def test_padded_vocab_is_the_same_for_power_of_two_tp() -> None:
    assert [padded_vocab_size(151936, tp) for tp in (1, 2, 4, 8)] == [151936] * 4
    assert [padded_vocab_size(250, tp) for tp in (1, 2, 3, 4)] == [256, 256, 384, 256]
    assert padded_vocab_size(49152, 3) == 49152


def test_fused_qkv_is_grouped_per_key_value_head() -> None:
    # 4 query heads in 2 groups, head_dim 1, hidden 1: q = 0..3, k = 10, 11, v = 20, 21.
    arch = tiny_arch(num_heads=4, num_kv_heads=2, head_dim=1, hidden_size=1)
    q, k, v = torch.arange(4.0)[:, None], torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    fused = QKV.to_mcore([q, k, v], arch)
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.reshape(-1).tolist() for t in QKV.to_hf(fused, arch)] == [[0, 1, 2, 3], [10, 11], [20, 21]]
    # TP=2 takes one whole group per rank
    assert shard(fused, Split.COLUMN, 1, 2)[:, 0].tolist() == [2, 3, 11, 21]


def test_gated_fc1_shards_hold_their_gate_and_up_halves() -> None:
    gate, up = torch.arange(4.0)[:, None], torch.arange(10.0, 14.0)[:, None]
    fused = GATE_UP.to_mcore([gate, up], tiny_arch())
    shards = [shard(fused, Split.GATED_COLUMN, r, 2) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    assert torch.equal(unshard(shards, Split.GATED_COLUMN), fused)
    # the classic bug: concatenating the shards as plain column shards interleaves gate and up
    assert not torch.equal(unshard(shards, Split.COLUMN), fused)


@pytest.mark.parametrize("split", list(Split))
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shard_unshard_round_trip(split: Split, tp: int) -> None:
    rows = 24 if split is not Split.VOCAB else 250
    full = torch.randn(rows, 12)
    padded = padded_vocab_size(250, tp)
    shards = [shard(full, split, r, tp, padded_rows=padded) for r in range(tp)]
    if split is Split.VOCAB:
        assert all(s.shape[0] == padded // tp for s in shards)
        assert torch.count_nonzero(torch.cat(shards)[250:]) == 0  # padding rows are zero
    assert torch.equal(unshard(shards, split, rows=rows), full)


def test_shard_rejects_sizes_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match=r"a row tensor of shape \(4, 6\) does not split over TP 4"):
        shard(torch.zeros(4, 6), Split.ROW, 0, 4)
    with pytest.raises(ValueError, match="padded vocab 100 must be >= 250 and divisible by TP 2"):
        shard(torch.zeros(250, 2), Split.VOCAB, 0, 2, padded_rows=100)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_hf_megatron_round_trip_is_exact(family: str, tied: bool) -> None:
    arch, state = hf_state(family, tie_word_embeddings=tied)
    converter = Converter(arch)
    mcore = converter.hf_to_mcore(state)
    assert list(mcore) == converter.mcore_names()
    assert ("output_layer.weight" in mcore) is not tied
    back = dict(converter.mcore_to_hf(mcore.items()))
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_transformer_engine_names_of_fused_norms() -> None:
    arch, _ = hf_state("qwen3")
    names = Converter(arch, te_layout=True).mcore_names()
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    assert "decoder.layers.2.self_attention.q_layernorm.weight" in names


def test_family_tables_differ_only_in_their_extras() -> None:
    llama, qwen2, qwen3 = (set(FAMILY_RULES[f]) for f in FAMILIES)
    assert {r.mcore for r in qwen2 - llama} == {"decoder.layers.{i}.self_attention.linear_qkv.bias"}
    assert {r.mcore for r in qwen3 - llama} == {
        "decoder.layers.{i}.self_attention.q_layernorm.weight",
        "decoder.layers.{i}.self_attention.k_layernorm.weight",
    }


def test_missing_and_unknown_tensors_are_reported() -> None:
    arch, state = hf_state("qwen2")
    converter = Converter(arch)
    del state["model.layers.1.self_attn.k_proj.bias"]
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        KeyError, match=re.escape("missing ['model.layers.1.self_attn.k_proj.bias'], unexpected ['model.layers.0")
    ):
        converter.hf_to_mcore(state)
    with pytest.raises(
        KeyError, match=re.escape("no qwen2 conversion rule for Megatron tensor 'decoder.layers.0.mlp.router'")
    ):
        converter.rule_for("decoder.layers.0.mlp.router")
