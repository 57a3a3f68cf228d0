"""Core attention for the local layer spec through `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` materialises the [b, heads, s, s] scores, masks and soft-maxes them
in separate kernels, copies them several times and runs a p = 0 dropout; on CPU that is about a third of a
training step at 256 tokens and grows with s². torch's SDPA does the same maths in fused (flash / memory-
efficient) kernels on CPU and GPU, handles grouped-query attention without repeating K/V, and is what the
`transformers` models use. It is a drop-in replacement: same constructor and forward signature, no
parameters, so checkpoints do not change. Transformer Engine's attention is used instead whenever the TE
layer spec is (GPU).
"""

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention import sdpa_kernel

from userrl_megatron.attention_backends import SDPA_BACKENDS


class SDPAttention(MegatronModule):
    """[s, b, heads, d] query / [s, b, groups, d] key, value -> [s, b, heads * d] context, causal."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine attention, not SDPAttention")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout or config.softmax_type != "vanilla" or config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention supports neither attention dropout nor non-vanilla softmax")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.causal = attn_mask_type == AttnMaskType.causal

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        """`attention_mask` follows Megatron's convention (True = masked out); None means causal."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes neither packed sequences nor an attention bias")
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        causal = self.causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask
        with sdpa_kernel(SDPA_BACKENDS):  # no cuDNN: a graph build per sequence length
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.groups != self.heads
            )
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)
