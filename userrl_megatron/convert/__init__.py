"""HF <-> Megatron conversion rules (pure torch, no Megatron import), shared by weight sync and the converters.

arch.py      the model's shape from an HF config.json; vocabulary padding
rules.py     one rule table per family (Llama, Qwen2, Qwen3, Qwen3-MoE): names, fused layouts, TP split kinds
sharding.py  tensor-parallel shards of full tensors and back
assembly.py  an HF tensor as pieces of TP shards, filled straight into a destination (weight sync) or built
hf_io.py     lazy safetensors reading; writing HF directories (shards, index, config, tokenizer)
"""

import importlib
from typing import Any

from userrl_megatron.convert.arch import Architecture, UnsupportedModelError, padded_vocab_size

# The torch-based names load on first use, so that reading a model's shape (config checks) imports no torch.
_LAZY = {"FAMILY_RULES": "rules", "Converter": "rules", "Rule": "rules", "Split": "rules", "shard": "sharding"}
_LAZY["unshard"] = "sharding"
_LAZY["TensorPlan"] = "assembly"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"userrl_megatron.convert.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILY_RULES",
    "Architecture",
    "Converter",
    "Rule",
    "Split",
    "TensorPlan",
    "UnsupportedModelError",
    "padded_vocab_size",
    "shard",
    "unshard",
]
