"""The shape of a dense decoder-only model, read from a Hugging Face `config.json` (pure Python, no torch).

Everything the converters and the Megatron model builder need: sizes, which optional weights exist (QKV bias,
QK-norm, a separate LM head), the rope base and the norm epsilon. Unsupported variants fail here, by name,
before any weight is touched.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_DIVISIBLE_BY = 128


class UnsupportedModelError(ValueError):
    """The Hugging Face config describes a model (or a variant of one) this project cannot convert."""


@dataclass(frozen=True)
class Architecture:
    """A dense Llama / Qwen2 / Qwen3 transformer: what the config says, normalised across families."""

    family: str  # "llama", "qwen2" or "qwen3" (the HF model_type)
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
        layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embed + self.hidden_size

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
            qk_norm=family == "qwen3",
            norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(_rope_parameters(config).get("rope_theta", config.get("rope_theta") or 10000.0)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
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
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv:
        raise UnsupportedModelError(
            f"{family}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
