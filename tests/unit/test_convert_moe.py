"""Qwen3-MoE conversion rules against hand-built layouts: names, fused expert gate/up, router, TE grouped-GEMM
names, tensor-parallel expert shards, and the architecture's MoE fields and refusals (pure torch)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import MOE_FAMILY, tiny_config
from userrl_megatron.convert import Architecture, Converter, Split, UnsupportedModelError, shard, unshard

E, H, F = 8, 64, 32  # experts, hidden size, expert width of the tiny model


def moe_arch(**overrides: object) -> Architecture:
    return Architecture.from_hf_config(tiny_config(MOE_FAMILY, **overrides).to_dict())


def hand_built_hf(arch: Architecture) -> dict[str, torch.Tensor]:
    """An HF Qwen3-MoE state dict as saved on disk (one tensor per expert projection), every value distinct."""
    gen = torch.Generator().manual_seed(0)
    d, q, kv = arch.head_dim, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    state = {"model.embed_tokens.weight": rnd(arch.vocab_size, H), "model.norm.weight": rnd(H)}
    state["lm_head.weight"] = rnd(arch.vocab_size, H)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": rnd(H),
            p + "post_attention_layernorm.weight": rnd(H),
            p + "self_attn.q_proj.weight": rnd(q, H),
            p + "self_attn.k_proj.weight": rnd(kv, H),
            p + "self_attn.v_proj.weight": rnd(kv, H),
            p + "self_attn.o_proj.weight": rnd(H, q),
            p + "self_attn.q_norm.weight": rnd(d),
            p + "self_attn.k_norm.weight": rnd(d),
            p + "mlp.gate.weight": rnd(E, H),
        }
        for e in range(E):
            state |= {
                p + f"mlp.experts.{e}.gate_proj.weight": rnd(F, H),
                p + f"mlp.experts.{e}.up_proj.weight": rnd(F, H),
                p + f"mlp.experts.{e}.down_proj.weight": rnd(H, F),
            }
    return state


def test_architecture_reads_the_moe_fields() -> None:
    arch = moe_arch(router_aux_loss_coef=0.01)
    assert (arch.family, arch.is_moe, arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size) == (
        "qwen3_moe",
        True,
        8,
        2,
        32,
    )
    assert (arch.norm_topk_prob, arch.router_aux_loss_coef, arch.qk_norm, arch.qkv_bias) == (True, 0.01, True, False)
    model = AutoModelForCausalLM.from_config(tiny_config(MOE_FAMILY))
    assert arch.num_parameters == sum(p.numel() for p in model.parameters())
    # a token passes 2 of 8 experts in each of 4 layers: 6 idle experts x 3 x 64 x 32 x 4 layers fewer
    assert arch.num_parameters - arch.num_active_parameters == 6 * 3 * H * F * 4
    dense = Architecture.from_hf_config(tiny_config("qwen3").to_dict())
    assert (dense.is_moe, dense.num_experts) == (False, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [1]}, "dense layers between MoE layers"),
        ({"decoder_sparse_step": 2}, "every layer must be MoE"),
        ({"num_experts_per_tok": 9}, "1 <= num_experts_per_tok <= num_experts, got 8 and 9"),
    ],
)
def test_unsupported_moe_variants_fail_by_name(change: dict, message: str) -> None:
    config = tiny_config(MOE_FAMILY).to_dict() | change
    with pytest.raises(UnsupportedModelError, match=message):
        Architecture.from_hf_config(config)


def test_hf_to_megatron_expert_layout_by_hand() -> None:
    arch = moe_arch()
    hf = hand_built_hf(arch)
    mcore = Converter(arch).hf_to_mcore(hf)
    layer = "decoder.layers.2.mlp."
    assert torch.equal(mcore[layer + "router.weight"], hf["model.layers.2.mlp.gate.weight"])
    for e in (0, 5, 7):
        fc1 = mcore[layer + f"experts.local_experts.{e}.linear_fc1.weight"]
        assert fc1.shape == (2 * F, H)
        assert torch.equal(fc1[:F], hf[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(fc1[F:], hf[f"model.layers.2.mlp.experts.{e}.up_proj.weight"])
        fc2 = mcore[layer + f"experts.local_experts.{e}.linear_fc2.weight"]
        assert torch.equal(fc2, hf[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])
    assert torch.equal(
        mcore["decoder.layers.1.pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"]
    )
    # embedding, head, final norm; per layer: qkv, proj, q/k norms, 2 norms, router and fc1 + fc2 per expert
    expected = 3 + arch.num_layers * (4 + 2 + 1 + 2 * E)
    assert len(mcore) == expected
    assert not any("linear_fc1.layer_norm_weight" in n or ".mlp.linear_fc" in n for n in mcore)
    back = dict(Converter(arch).mcore_to_hf(mcore.items()))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_transformer_engine_grouped_gemm_names() -> None:
    arch = moe_arch()
    names = Converter(arch, te_layout=True).mcore_names()
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight7" in names
    assert "decoder.layers.3.mlp.experts.linear_fc2.weight0" in names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names  # MoE layers keep a separate norm under TE
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    converter = Converter(arch, te_layout=True)
    rule, at = converter.rule_for("decoder.layers.3.mlp.experts.linear_fc2.weight6")
    assert at == {"i": 3, "e": 6} and rule.split is Split.ROW
    assert converter.hf_sources("decoder.layers.1.mlp.experts.linear_fc1.weight2") == [
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight",
    ]


def test_expert_tensor_parallel_shards_by_hand() -> None:
    arch = moe_arch()
    hf = hand_built_hf(arch)
    converter = Converter(arch)
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    full = converter.hf_to_mcore(hf)[name]
    gate, up = hf["model.layers.0.mlp.experts.3.gate_proj.weight"], hf["model.layers.0.mlp.experts.3.up_proj.weight"]
    rank1 = shard(full, converter.split_of(name), 1, 2)
    assert torch.equal(rank1, torch.cat([gate[F // 2 :], up[F // 2 :]]))  # [gate half; up half] of rank 1
    down_name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    down = hf["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert torch.equal(shard(down, converter.split_of(down_name), 0, 2), down[:, : F // 2])
    assert torch.equal(unshard([shard(full, Split.GATED_COLUMN, r, 2) for r in range(2)], Split.GATED_COLUMN), full)
    assert converter.split_of("decoder.layers.0.mlp.router.weight") is Split.REPLICATED
