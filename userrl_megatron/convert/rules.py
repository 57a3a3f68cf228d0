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

Each rule also says how Megatron shards the tensor across tensor-parallel ranks (`Split`), so loading,
exporting and checkpoint tools agree on one table.
"""

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from userrl_megatron.convert.arch import Architecture


class Split(Enum):
    """How Megatron shards a full tensor across tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds the whole tensor (norms)
    COLUMN = "column"  # rows split evenly (QKV weight/bias: whole GQA groups per rank)
    ROW = "row"  # columns split evenly (attention output, MLP down projection)
    GATED_COLUMN = "gated_column"  # [gate; up] rows: each rank holds [gate shard; up shard]
    VOCAB = "vocab"  # vocabulary rows, zero-padded to Megatron's padded vocab size, then split evenly


ToMcore = Callable[[Sequence[torch.Tensor], Architecture], torch.Tensor]
ToHf = Callable[[torch.Tensor, Architecture], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of; `{i}` stands for the global layer index."""

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
    """Megatron's per-group interleaved QKV -> HF (q, k, v)."""
    d, rest = arch.head_dim, fused.shape[1:]
    grouped = fused.reshape(arch.num_kv_heads, (arch.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [arch.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


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

# One table per family. Llama: plain dense; Qwen2: + q/k/v biases; Qwen3: + per-head RMSNorm on q and k.
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {
    "llama": _DENSE,
    "qwen2": (*_DENSE, QKV_BIAS),
    "qwen3": (*_DENSE, Q_NORM, K_NORM),
}


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


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

    def _layers(self, rule: Rule) -> range:
        return range(self.arch.num_layers) if "{i}" in rule.mcore else range(1)

    def mcore_names(self) -> list[str]:
        """Every Megatron tensor name of the model, in rule order then layer order."""
        return [self.mcore_template(r).format(i=i) for r in self.rules for i in self._layers(r)]

    def hf_names(self) -> list[str]:
        """Every HF tensor name of the model."""
        return [h.format(i=i) for r in self.rules for i in self._layers(r) for h in r.hf]

    def rule_for(self, mcore_name: str) -> tuple[Rule, int | None]:
        """The rule matching a global Megatron name, and its layer index (None outside the layers)."""
        for pattern, rule in self._patterns:
            match = pattern.match(mcore_name)
            if match:
                return rule, int(match.group("i")) if "{i}" in rule.mcore else None
        raise KeyError(f"no {self.arch.family} conversion rule for Megatron tensor {mcore_name!r}")

    def split_of(self, mcore_name: str) -> Split:
        """How Megatron shards this tensor across tensor-parallel ranks."""
        return self.rule_for(mcore_name)[0].split

    def to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One full Megatron tensor -> its HF (name, tensor) pairs."""
        rule, layer = self.rule_for(mcore_name)
        parts = rule.to_hf(tensor, self.arch)
        return [(h.format(i=layer), p.contiguous()) for h, p in zip(rule.hf, parts, strict=True)]

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
            for i in self._layers(rule):
                out[self.mcore_template(rule).format(i=i)] = rule.to_mcore(
                    [hf[h.format(i=i)] for h in rule.hf], self.arch
                )
        return out

    def mcore_to_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (Megatron name, full tensor) pairs as HF (name, tensor) pairs."""
        for name, tensor in tensors:
            yield from self.to_hf(name, tensor)
