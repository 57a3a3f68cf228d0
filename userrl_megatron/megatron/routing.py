"""Rollout routing replay: the trainer's MoE routers take the experts the rollout engine chose.

The engine returns, per episode, the top-k expert ids every MoE layer chose for positions 0 … n − 1 (every
position it ran: prompt, policy and reply tokens alike; `TrainBatch.routed_experts`). Each Megatron router of
the actor gets a `RoutingReplay` in its `router_replay` slot, the hook `topk_routing_with_score_function` calls
for the top-k. For a position with engine routing the replayed ids replace the router's own; elsewhere (the
last token of an episode, padding, episodes without routing) the router's own top-k stands.

Replayed are the expert *indices* only. The gate weights are recomputed from the trainer's router logits of
those experts (Megatron's softmax over the k chosen logits), so the router still gets gradients, and the
load-balancing loss keeps Megatron's own statistics of the router scores.

Token order: a micro-batch enters the decoder as [s, b] (sequence first), so router token i is position
(i // b, i % b) of the [b, s] model input; under sequence parallelism a rank's routers see its 1 / TP slice
of s.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter

from userrl_megatron.megatron.packing import ModelInput


@dataclass
class RoutingTarget:
    """The engine's choice for one micro-batch, in router token order."""

    ids: torch.Tensor  # [tokens, layers, top_k] int64 (0 where `known` is False)
    known: torch.Tensor  # [tokens] bool: positions whose engine routing exists


def routing_target(
    inp: ModelInput,
    routed: list[np.ndarray],
    layers: int,
    top_k: int,
    tp: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
) -> RoutingTarget:
    """Build the micro-batch's `RoutingTarget`; `routed[r]` is row r's int32 [n, layers x top_k] engine routing."""
    row, col = inp.row.t().reshape(-1).cpu(), inp.col.t().reshape(-1).cpu()  # router token order ([s, b])
    if sequence_parallel and tp > 1:
        part = slice(tp_rank * len(row) // tp, (tp_rank + 1) * len(row) // tp)  # [s, b]: a slice of s is one of i
        row, col = row[part], col[part]
    ids = torch.zeros(len(row), layers, top_k, dtype=torch.long)
    known = torch.zeros(len(row), dtype=torch.bool)
    for r, table in enumerate(routed):
        if table is None or len(table) == 0:
            continue
        if table.shape[1] != layers * top_k:
            raise ValueError(
                f"episode {r}: the engine routed {table.shape[1]} experts per position, the model has "
                f"{layers} layers x top-{top_k} = {layers * top_k}"
            )
        at = (row == r) & (col >= 0) & (col < len(table))
        if at.any():
            ids[at] = torch.from_numpy(table[col[at].numpy()].astype(np.int64)).view(-1, layers, top_k)
            known[at] = True
    return RoutingTarget(ids, known)


class RoutingReplay:
    """One router's replay hook (duck-typed as Megatron's `RouterReplay` for `topk_routing_with_score_function`)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # 0-based global layer index
        self.target: RoutingTarget | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores of the chosen experts, their ids): the engine's ids where known, the router's elsewhere."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is None or not bool(target.known.any()):
            return values, indices
        if len(target.known) != scores.shape[0]:
            raise RuntimeError(f"routing replay: {len(target.known)} target tokens, the router has {scores.shape[0]}")
        known = target.known.to(scores.device)[:, None]
        indices = torch.where(known, target.ids[:, self.layer].to(scores.device), indices)
        return scores.gather(1, indices), indices


def install(chunks: list[torch.nn.Module]) -> list[RoutingReplay]:
    """Put a `RoutingReplay` into every MoE router of the model chunks; returns them."""
    hooks = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:
                    raise ValueError("routing replay needs the unfused router (moe_router_fusion off)")
                hook = RoutingReplay(int(module.layer_number) - 1)
                module.router_replay = hook
                hooks.append(hook)
    if not hooks:
        raise ValueError("routing replay needs a mixture-of-experts model (no MoE router found)")
    return hooks


def set_target(hooks: list[RoutingReplay], target: RoutingTarget | None) -> None:
    """Replay `target` in the next forward of every router (None: each router routes by itself)."""
    for hook in hooks:
        hook.target = target
