"""A tiny random chat model that ends its turns: real engine episodes in tests and benchmarks stay multi-turn.

A random model rarely samples `<|im_end|>`, so every turn would run to its token limit. Scaling that token's
row of the output head makes its logit swing widely: at some positions it dominates and the turn ends.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import make_tiny_model


def make_chatty_model(out_dir: Path, eos_scale: float = 60.0, seed: int = 0, **overrides: object) -> Path:
    """A tiny Llama with the character tokenizer (tests.support.char_tokenizer) and a scaled `<|im_end|>` row."""
    from transformers import AutoTokenizer

    overrides.setdefault("max_position_embeddings", 4096)
    make_tiny_model("llama", out_dir, seed=seed, tokenizer="char", **overrides)
    eos = AutoTokenizer.from_pretrained(out_dir).convert_tokens_to_ids("<|im_end|>")
    weights_file = out_dir / "model.safetensors"
    weights = load_file(weights_file)
    with torch.no_grad():
        weights["lm_head.weight"][eos] *= eos_scale
    save_file(weights, weights_file, metadata={"format": "pt"})
    return out_dir
