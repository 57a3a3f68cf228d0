"""HF <-> Megatron conversion rules (pure torch, no Megatron import), shared by weight sync and the converters.

arch.py      the model's shape from an HF config.json; vocabulary padding
rules.py     one rule table per family (Llama, Qwen2, Qwen3): names, fused layouts, TP split kinds
sharding.py  tensor-parallel shards of full tensors and back
hf_io.py     lazy safetensors reading; writing HF directories (shards, index, config, tokenizer)
"""

from userrl_megatron.convert.arch import Architecture, UnsupportedModelError, padded_vocab_size
from userrl_megatron.convert.rules import FAMILY_RULES, Converter, Rule, Split
from userrl_megatron.convert.sharding import shard, unshard

__all__ = [
    "FAMILY_RULES",
    "Architecture",
    "Converter",
    "Rule",
    "Split",
    "UnsupportedModelError",
    "padded_vocab_size",
    "shard",
    "unshard",
]
