"""The embedded engine's attention: transformers' SDPA, except that on CPU a masked prefill keeps the KV heads grouped.

Before a masked SDPA call, transformers repeats each key/value head once per query head of its group (CUDA's
kernels fall back to plain math for grouped heads under a mask). torch's CPU kernels take grouped heads with a mask
and give the same numbers, without the copy: for a padded prefill of 102 rows over 180 keys (SmolLM2, 3 KV heads
for 9 query heads) a layer's attention takes 6.6 ms instead of 34 ms. Every other call is transformers' own.
"""

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "userrl_engine_sdpa"  # the `attn_implementation` the engine loads its model with


def engine_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, with grouped KV heads passed as they are on CPU under a mask."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    masked_prefill = attention_mask is not None and query.shape[2] > 1
    if not (grouped and masked_prefill and query.device.type == "cpu") or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `NAME` an attention implementation (with SDPA's masks) transformers can load a model with."""
    AttentionInterface.register(NAME, engine_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
