"""`userrl plan` for mixture-of-experts models: expert shards over TP x EP, their optimizer state over the
expert-data-parallel ranks, and the published Qwen3-30B-A3B shape (counted by hand)."""

import dataclasses

from userrl_megatron.config.model_fit import PUBLISHED_SHAPES
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.plan.memory import actor_memory, layer_parameters

TINY_MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "moe_intermediate_size": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 32,
    "rms_norm_eps": 1e-6,
}


def test_moe_shards_by_hand() -> None:
    arch = Architecture.from_hf_config(TINY_MOE)
    # attention 8 x (2x4 + 2x1x4) + 2x4 x 8 + q/k norms 2x4 = 200; router 4 x 8 = 32; experts 4 x 3 x 8 x 2 = 192;
    # two norms 16
    assert layer_parameters(arch) == 200 + 32 + 192 + 16
    cfg = MegatronConfig(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        micro_batch_tokens=64,
        transformer_impl="transformer_engine",
    )
    m = actor_memory(arch, cfg, "bfloat16", world=4)  # DP 2, EP 2 over it: expert-data-parallel size 1
    # per rank and layer: attention 200 / 2, router + norms 48 whole, experts 192 / (TP2 x EP2) = 48 -> 196;
    # 4 layers + embedding 32 x 8 / 2 + final norm 8 + output layer 128 = 1048
    assert m.weights == 1048 * 2
    # Adam + master (12 bytes): the 4 x 48 expert parameters over EDP 1, the other 856 over DP 2
    assert m.optimizer == 856 * 12 // 2 + 4 * 48 * 12
    # activations: 4h norms + 2q + 2kv + top-2 x (3 x 2 + 2 x 8) = 32 + 16 + 8 + 44 = 100 values per token
    assert m.forward_activations == 2 * 64 * ((100 - 32) // 2 + 32) * 2
    # the local spec: 32 + 3q + 3kv + top-2 x (5 x 2 + 2 x 8) = 32 + 24 + 12 + 52 = 120
    local = actor_memory(arch, dataclasses.replace(cfg, transformer_impl="local"), "bfloat16", world=4)
    assert local.forward_activations == 2 * 64 * ((120 - 32) // 2 + 32) * 2


def test_qwen3_30b_a3b_published_shape() -> None:
    arch = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-30b-a3b"])
    assert round(arch.num_parameters / 1e9, 1) == 30.5  # "30.5B in total"
    assert round(arch.num_active_parameters / 1e9, 2) == 3.35  # the model card: "3.3B activated"
    assert (arch.num_experts, arch.moe_top_k, arch.norm_topk_prob, arch.router_aux_loss_coef) == (128, 8, True, 0.001)
