"""HF <-> Megatron name and layout rules, one table per model family (pure torch: weight sync reuses them).

A rule maps one Megatron tensor (global name: decoder layers numbered across pipeline stages, full
tensor: no tensor-parallel sharding, vocabulary unpadded) to one or more Hugging Face tensors, and back:

  * fused QKV: Megatron's `linear_qkv` rows are grouped per key/value head (GQA group): for each group, its
    query heads, then its key head, then its value head. Splitting by group is what makes plain row chunks
    valid tensor-parallel shards.
  * fused gate/up: `linear_fc1` is [gate; up] (SwiGLU).
  * norms: the local layer spec has `input_layernorm` / `pre_mlp_layernorm`; the Transformer Engine spec
    fuses them into the following linear layer as `layer_norm_weight` (`Rule.mcore_te`).
  * tied embeddings: no `output_layer` / `lm_head` tensor.
  * mixture of experts (Qwen3-MoE): the router is `mlp.router.weight` (HF `mlp.gate.weight`); expert `{e}`
    (its index among all experts of the layer) is `mlp.experts.local_experts.{e}.linear_fc1/fc2` under the
    local spec (SequentialMLP) and `mlp.experts.linear_fc1/fc2.weight{e}` under Transformer Engine's grouped
    GEMM (TEGroupedMLP), whose MoE layers keep a separate `pre_mlp_layernorm`. Parameters of a model chunk
    number experts from 0 on each expert-parallel rank; `megatron.model.global_name` turns them into these
    model-wide indices. Experts are sharded over the expert tensor-parallel group like a dense MLP.

Each rule also says how Megatron shards the tensor across tensor-parallel ranks (`Split`), so loading,
exporting and checkpoint tools agree on one table. A rule's `to_hf` returns views, and applies as well to one
tensor-parallel shard as to the full tensor (a shard holds whole GQA groups, its own gate and up halves): the
export turns each shard into its pieces of every HF tensor (`Converter.plans`) and never builds the full tensor.
"""

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from userrl_megatron.convert.arch import Architecture
from userrl_megatron.convert.assembly import TensorPlan, cut_rows


class Split(Enum):
    """How Megatron shards a full tensor across tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds the whole tensor (norms)
    COLUMN = "column"  # rows split evenly (QKV weight/bias: whole GQA groups per rank)
    ROW = "row"  # columns split evenly (attention output, MLP down projection)
    GATED_COLUMN = "gated_column"  # [gate; up] rows: each rank holds [gate shard; up shard]
    VOCAB = "vocab"  # vocabulary rows, zero-padded to Megatron's padded vocab size, then split evenly


ToMcore = Callable[[Sequence[torch.Tensor], Architecture], torch.Tensor]
# One view per HF tensor, holding its elements in row-major order (a reshape gives the HF tensor).
ToHf = Callable[[torch.Tensor, Architecture], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of; `{i}` stands for the global layer index and
    `{e}` for the expert index within the layer."""

    mcore: str
    hf: tuple[str, ...]
    split: Split
    to_mcore: ToMcore
    to_hf: ToHf
    mcore_te: str | None = None  # the name under the Transformer Engine layer spec, when it differs


def _same(tensors: Sequence[torch.Tensor], arch: Architecture) -> torch.Tensor:
    return tensors[0]


def _as_one(tensor: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor]:
    return (tensor,)


def fuse_qkv(tensors: Sequence[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """[q; k; v] (HF, weights or biases) -> Megatron's per-group interleaved QKV."""
    q, k, v = tensors
    groups = arch.num_kv_heads
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], 1)
    return fused.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-group interleaved QKV (all groups, or a TP shard's) -> views of HF (q, k, v), each
    [groups, rows per group, ...]."""
    d, rest = arch.head_dim, fused.shape[1:]
    grouped = fused.reshape(-1, (arch.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [arch.heads_per_group * d, d, d], dim=1)
    return q, k, v


def fuse_gate_up(tensors: Sequence[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """(gate, up) -> Megatron's fc1 = [gate; up]."""
    return torch.cat(list(tensors), dim=0)


def split_gate_up(fused: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, ...]:
    """Megatron's fc1 = [gate; up] -> (gate, up)."""
    return tuple(torch.chunk(fused, 2, dim=0))


LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."

EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB, _same, _as_one)
OUTPUT_LAYER = Rule("output_layer.weight", ("lm_head.weight",), Split.VOCAB, _same, _as_one)
FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED, _same, _as_one)
INPUT_NORM = Rule(
    LAYER + "input_layernorm.weight",
    (HF_LAYER + "input_layernorm.weight",),
    Split.REPLICATED,
    _same,
    _as_one,
    mcore_te=LAYER + "self_attention.linear_qkv.layer_norm_weight",
)
QKV = Rule(
    LAYER + "self_attention.linear_qkv.weight",
    tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
    Split.COLUMN,
    fuse_qkv,
    split_qkv,
)
QKV_BIAS = Rule(
    LAYER + "self_attention.linear_qkv.bias",
    tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
    Split.COLUMN,
    fuse_qkv,
    split_qkv,
)
Q_NORM = Rule(
    LAYER + "self_attention.q_layernorm.weight",
    (HF_LAYER + "self_attn.q_norm.weight",),
    Split.REPLICATED,
    _same,
    _as_one,
)
K_NORM = Rule(
    LAYER + "self_attention.k_layernorm.weight",
    (HF_LAYER + "self_attn.k_norm.weight",),
    Split.REPLICATED,
    _same,
    _as_one,
)
ATTN_OUT = Rule(
    LAYER + "self_attention.linear_proj.weight", (HF_LAYER + "self_attn.o_proj.weight",), Split.ROW, _same, _as_one
)
MLP_NORM = Rule(
    LAYER + "pre_mlp_layernorm.weight",
    (HF_LAYER + "post_attention_layernorm.weight",),
    Split.REPLICATED,
    _same,
    _as_one,
    mcore_te=LAYER + "mlp.linear_fc1.layer_norm_weight",
)
GATE_UP = Rule(
    LAYER + "mlp.linear_fc1.weight",
    (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
    Split.GATED_COLUMN,
    fuse_gate_up,
    split_gate_up,
)
DOWN = Rule(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + "mlp.down_proj.weight",), Split.ROW, _same, _as_one)

_DENSE = (EMBEDDING, OUTPUT_LAYER, FINAL_NORM, INPUT_NORM, QKV, ATTN_OUT, MLP_NORM, GATE_UP, DOWN)

MOE_NORM = Rule(
    LAYER + "pre_mlp_layernorm.weight",
    (HF_LAYER + "post_attention_layernorm.weight",),
    Split.REPLICATED,
    _same,
    _as_one,
)
ROUTER = Rule(LAYER + "mlp.router.weight", (HF_LAYER + "mlp.gate.weight",), Split.REPLICATED, _same, _as_one)
HF_EXPERT = HF_LAYER + "mlp.experts.{e}."
EXPERT_GATE_UP = Rule(
    LAYER + "mlp.experts.local_experts.{e}.linear_fc1.weight",
    (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
    Split.GATED_COLUMN,
    fuse_gate_up,
    split_gate_up,
    mcore_te=LAYER + "mlp.experts.linear_fc1.weight{e}",
)
EXPERT_DOWN = Rule(
    LAYER + "mlp.experts.local_experts.{e}.linear_fc2.weight",
    (HF_EXPERT + "down_proj.weight",),
    Split.ROW,
    _same,
    _as_one,
    mcore_te=LAYER + "mlp.experts.linear_fc2.weight{e}",
)
EXPERT_RULES = (EXPERT_GATE_UP, EXPERT_DOWN)

# One table per family. Llama: plain dense; Qwen2: + q/k/v biases; Qwen3: + per-head RMSNorm on q and k;
# Qwen3-MoE: Qwen3's attention, a router and routed experts in every layer.
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "llama": _DENSE,
    "qwen2": (*_DENSE, QKV_BIAS),
    "qwen3": (*_DENSE, Q_NORM, K_NORM),
    "qwen3_moe": (
        EMBEDDING,
        OUTPUT_LAYER,
        FINAL_NORM,
        INPUT_NORM,
        QKV,
        ATTN_OUT,
        Q_NORM,
        K_NORM,
        MOE_NORM,
        ROUTER,
        *EXPERT_RULES,
    ),
}


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
    return re.compile(escaped + "$")


def is_expert_rule(rule: Rule) -> bool:
    """Whether the rule's tensor belongs to one routed expert (sharded over expert-parallel ranks)."""
    return "{e}" in rule.mcore


class Converter:
    """Converts between full HF tensors and full Megatron tensors of one model, with its family's rules.

    `te_layout` selects the Transformer Engine names of the fused norms. `rules` replaces the family table
    (tests use it to check that a wrong mapping is caught).
    """

    def __init__(self, arch: Architecture, te_layout: bool = False, rules: Iterable[Rule] | None = None) -> None:
        self.arch = arch
        self.te_layout = te_layout
        table = FAMILY_RULES[arch.family] if rules is None else tuple(rules)
        self.rules = tuple(r for r in table if not (r is OUTPUT_LAYER and arch.tied_embeddings))
        self._patterns = [(_pattern(self.mcore_template(r)), r) for r in self.rules]

    def mcore_template(self, rule: Rule) -> str:
        """The rule's Megatron name template under this converter's layer spec."""
        return rule.mcore_te if self.te_layout and rule.mcore_te else rule.mcore

    def _indices(self, rule: Rule) -> list[dict[str, int]]:
        layers = range(self.arch.num_layers) if "{i}" in rule.mcore else range(1)
        experts = range(self.arch.num_experts) if "{e}" in rule.mcore else [None]
        return [{"i": i} if e is None else {"i": i, "e": e} for i in layers for e in experts]

    def mcore_names(self) -> list[str]:
        """Every Megatron tensor name of the model, in rule order then layer (then expert) order."""
        return [self.mcore_template(r).format(**at) for r in self.rules for at in self._indices(r)]

    def hf_names(self) -> list[str]:
        """Every HF tensor name of the model."""
        return [h.format(**at) for r in self.rules for at in self._indices(r) for h in r.hf]

    def rule_for(self, mcore_name: str) -> tuple[Rule, dict[str, int]]:
        """The rule matching a global Megatron name, and where it applies: {"i": layer, "e": expert}, each only
        when the rule has it."""
        for pattern, rule in self._patterns:
            match = pattern.match(mcore_name)
            if match:
                return rule, {k: int(v) for k, v in match.groupdict().items()}
        raise KeyError(f"no {self.arch.family} conversion rule for Megatron tensor {mcore_name!r}")

    def hf_sources(self, mcore_name: str) -> list[str]:
        """The HF names a Megatron tensor is made of."""
        rule, at = self.rule_for(mcore_name)
        return [h.format(**at) for h in rule.hf]

    def split_of(self, mcore_name: str) -> Split:
        """How Megatron shards this tensor across tensor-parallel ranks."""
        return self.rule_for(mcore_name)[0].split

    def to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One full Megatron tensor -> its HF (name, tensor) pairs."""
        return [(name, plan.materialize()) for name, plan in self.plans(mcore_name, [tensor])]

    def plans(
        self, mcore_name: str, shards: Sequence[torch.Tensor], transient: bool = False
    ) -> list[tuple[str, TensorPlan]]:
        """A Megatron tensor, given as every tensor-parallel rank's shard in rank order (or as one full tensor),
        -> (HF name, plan) of each HF tensor it makes: the rule applied to each shard gives its piece of every HF
        tensor, concatenated along the split dimension, vocabulary padding cut. No data is copied.
        `transient`: the shards' memory is reused once the plans are consumed (`TensorPlan.transient`)."""
        rule, at = self.rule_for(mcore_name)
        if rule.split is Split.REPLICATED:
            shards = shards[:1]
        per_shard = [rule.to_hf(s, self.arch) for s in shards]
        first, dim = shards[0], 1 if rule.split is Split.ROW else 0
        out = []
        for k, template in enumerate(rule.hf):
            pieces = [parts[k] for parts in per_shard]
            if rule.split is Split.VOCAB:
                pieces = cut_rows(pieces, self.arch.vocab_size)
            if dim == 1:
                shape = (first.shape[0], sum(p.shape[1] for p in pieces), *first.shape[2:])
            else:
                shape = (sum(p.numel() for p in pieces) // math.prod(first.shape[1:]), *first.shape[1:])
            out.append((template.format(**at), TensorPlan(shape, tuple(pieces), dim, transient)))
        return out

    def hf_to_mcore(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole HF state dict -> full Megatron tensors. Raises on missing or unexpected HF tensors."""
        expected = set(self.hf_names())
        ignored = {"lm_head.weight"} if self.arch.tied_embeddings else set()
        missing = sorted(expected - hf.keys())
        unexpected = sorted(hf.keys() - expected - ignored)
        if missing or unexpected:
            raise KeyError(f"HF {self.arch.family} state dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        out = {}
        for rule in self.rules:
            for at in self._indices(rule):
                out[self.mcore_template(rule).format(**at)] = rule.to_mcore(
                    [hf[h.format(**at)] for h in rule.hf], self.arch
                )
        return out

    def mcore_to_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (Megatron name, full tensor) pairs as HF (name, tensor) pairs."""
        for name, tensor in tensors:
            yield from self.to_hf(name, tensor)
