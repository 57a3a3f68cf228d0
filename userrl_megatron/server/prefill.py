"""Batched prefill: several new requests (each possibly resuming from a prefix-cache hit) in one forward.

Row i is laid out left-padded in two blocks: its reused prefix KV right-aligned in the past block
[0, P) and its new tokens right-aligned in the query block [P, P + N), where P and N are the longest prefix and
the longest new part. A 2-D attention mask hides the padding, position ids are each row's own, and every row's
last new token sits in the last column, so the last logits are each row's next-token logits. Short prefills are
bound by reading the weights, so one forward for many rows costs little more than one for a single row.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from userrl_megatron.server.model import EngineModel

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [kv_heads, length, head_dim]


@dataclass
class PrefillRow:
    tokens: list[int]  # the sequence whose KV the row must hold (prompt + outputs so far)
    reused: int = 0  # leading tokens whose KV comes from `prefix`
    prefix: LayerKV | None = None


def run_prefill(
    model: EngineModel, rows: list[PrefillRow], all_logits: bool = False, routing: bool = False
) -> tuple[torch.Tensor, list[LayerKV], list[torch.Tensor] | None]:
    """(logits, each row's KV over all of its tokens, each row's routed experts or None). Logits are
    [rows, vocab], or [1, length, vocab] with `all_logits` (one row without reuse only). With `routing` (MoE),
    row i's routed experts are int32 [new tokens of row i, layers, top_k], for positions reused … len(tokens)."""
    assert not all_logits or (len(rows) == 1 and rows[0].reused == 0)
    past = max(r.reused for r in rows)
    new = max(len(r.tokens) - r.reused for r in rows)
    # On the host, moved to the engine's device once by `model.forward`.
    ids = torch.zeros(len(rows), new, dtype=torch.long)
    positions = torch.zeros(len(rows), new, dtype=torch.long)
    mask = torch.zeros(len(rows), past + new, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.tokens) - r.reused
        ids[i, new - n :] = torch.tensor(r.tokens[r.reused :])
        positions[i, new - n :] = torch.arange(r.reused, len(r.tokens))
        mask[i, past - r.reused : past] = 1
        mask[i, past + new - n :] = 1
    cache = DynamicCache(config=model.model.config)
    if past:
        cache = DynamicCache(ddp_cache_data=_past_block(rows, past), config=model.model.config)
    padded = not bool(mask.all())
    out = model.forward(
        ids, positions, cache, attention_mask=mask if padded else None, all_logits=all_logits, routing=routing
    )
    logits, routed = out if isinstance(out, tuple) else (out, None)  # a tuple exactly when `routing`
    layers: LayerKV = []
    for layer in cache.layers:  # attention layers, each holding the keys and values the forward wrote
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        layers.append((layer.keys, layer.values))
    per_row = []
    for i, r in enumerate(rows):
        n = len(r.tokens) - r.reused
        if not padded:
            per_row.append([(k[i], v[i]) for k, v in layers])
        else:
            per_row.append(
                [
                    (
                        torch.cat((k[i, :, past - r.reused : past], k[i, :, past + new - n :]), dim=1),
                        torch.cat((v[i, :, past - r.reused : past], v[i, :, past + new - n :]), dim=1),
                    )
                    for k, v in layers
                ]
            )
    routed_rows = None
    if routed is not None:
        routed_rows = [routed[i, new - (len(r.tokens) - r.reused) :] for i, r in enumerate(rows)]
    return logits, per_row, routed_rows


def _past_block(rows: list[PrefillRow], past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, [rows, kv_heads, past, head_dim] keys and values with each row's prefix right-aligned."""
    like = next(r.prefix for r in rows if r.prefix)
    blocks = []
    for layer, (k0, _) in enumerate(like):
        shape = (len(rows), k0.shape[0], past, k0.shape[2])
        keys = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
        values = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
        for i, r in enumerate(rows):
            if r.reused:
                assert r.prefix is not None  # a row reuses KV only from its prefix
                keys[i, :, past - r.reused :] = r.prefix[layer][0][:, : r.reused]
                values[i, :, past - r.reused :] = r.prefix[layer][1][:, : r.reused]
        blocks.append((keys, values))
    return blocks
