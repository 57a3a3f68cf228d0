"""The shape of a decoder-only model, read from a Hugging Face `config.json` (pure Python, no torch).

Everything the converters and the Megatron model builder need: sizes, which optional weights exist (QKV bias,
QK-norm, a separate LM head), the rope base, the norm epsilon and, for mixture-of-experts families
(Qwen3-MoE), the experts and their router. Unsupported variants fail here, by name, before any weight is
touched.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
VOCAB_DIVISIBLE_BY = 128


class UnsupportedModelError(ValueError):
    """The Hugging Face config describes a model (or a variant of one) this project cannot convert."""


@dataclass(frozen=True)
class Architecture:
    """A Llama / Qwen2 / Qwen3 / Qwen3-MoE transformer: what the config says, normalised across families.

    The MoE fields keep their dense defaults (no experts) for the dense families, so checkpoint metadata written
    before they existed still loads."""

    family: str  # "llama", "qwen2", "qwen3" or "qwen3_moe" (the HF model_type)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    moe_ffn_hidden_size: int = 0  # intermediate size of one expert
    moe_top_k: int = 0  # experts each token is routed to
    norm_topk_prob: bool = False  # the top-k routing weights are renormalised to sum to 1 (HF norm_topk_prob)
    router_aux_loss_coef: float = 0.0  # the HF config's load-balancing loss coefficient

    @property
    def is_moe(self) -> bool:
        """Every decoder layer's MLP is a mixture of routed experts."""
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        """Trainable parameters (the embedding counted once when tied)."""
        d, kv = self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (self.num_heads * d + 2 * kv) + self.num_heads * d * self.hidden_size
        if self.qkv_bias:
            attn += self.num_heads * d + 2 * kv
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        if self.is_moe:
            mlp = (
                self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size + self.num_experts * self.hidden_size
            )
        layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embed + self.hidden_size

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token passes through: the routed experts counted `moe_top_k` times, not all."""
        if not self.is_moe:
            return self.num_parameters
        idle = (self.num_experts - self.moe_top_k) * 3 * self.hidden_size * self.moe_ffn_hidden_size
        return self.num_parameters - self.num_layers * idle

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "Architecture":
        """Read a `config.json` dictionary; raises UnsupportedModelError naming the unsupported feature."""
        family = config.get("model_type")
        if family not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _check_supported(family, config)
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        moe = family in MOE_MODEL_TYPES
        return cls(
            family=family,
            num_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v biases; the others none
            qk_norm=family in ("qwen3", "qwen3_moe"),
            norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(_rope_parameters(config).get("rope_theta", config.get("rope_theta") or 10000.0)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            num_experts=_num_experts(config) if moe else 0,
            moe_ffn_hidden_size=config["moe_intermediate_size"] if moe else 0,
            moe_top_k=config["num_experts_per_tok"] if moe else 0,
            norm_topk_prob=bool(config.get("norm_topk_prob", False)) if moe else False,
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)) if moe else 0.0,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Architecture":
        """Read `<path>/config.json`."""
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of Megatron's (vocab-parallel) embedding: `vocab_size` rounded up to a multiple of lcm(128, tp).

    Using the lcm rather than 128·tp keeps the padded size the same for every power-of-two TP, so a checkpoint
    reshards between TP 1, 2, 4 and 8 without changing the embedding's shape.
    """
    multiple = math.lcm(divisible_by, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _check_supported(family: str, config: dict[str, Any]) -> None:
    rope_type = _rope_parameters(config).get("rope_type") or _rope_parameters(config).get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"{family}: rope_type {rope_type!r} is not supported (only 'default' rope)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{family}: hidden_act {act!r} is not supported (only SwiGLU with silu)")
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{family}: mlp_bias = true is not supported")
    if family != "qwen2" and config.get("attention_bias"):
        raise UnsupportedModelError(f"{family}: attention_bias = true (q/k/v/o biases) is not supported")
    if config.get("use_sliding_window"):
        raise UnsupportedModelError(f"{family}: sliding-window attention is not supported")
    if family in MOE_MODEL_TYPES:
        _check_moe(family, config)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv:
        raise UnsupportedModelError(
            f"{family}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )


def _num_experts(config: dict[str, Any]) -> int:
    # Qwen's published configs say num_experts; transformers 5 saves the same value as num_local_experts
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _check_moe(family: str, config: dict[str, Any]) -> None:
    experts, top_k = _num_experts(config), config.get("num_experts_per_tok") or 0
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedModelError(
            f"{family}: needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got {experts} and {top_k}"
        )
    if config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError(
            f"{family}: dense layers between MoE layers (mlp_only_layers {config.get('mlp_only_layers')}, "
            f"decoder_sparse_step {config.get('decoder_sparse_step')}) are not supported: every layer must be MoE"
        )
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"{family}: shared experts are not supported")
