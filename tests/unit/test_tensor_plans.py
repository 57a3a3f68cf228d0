"""Fill-in-place conversion: every family rule's HF tensors written from tensor-parallel shards straight into a
flat bucket (`Converter.plans`, `TensorPlan.fill`) are bit-identical to the full-tensor path (shards rebuilt,
then split by the rules and copied), at TP 1 and 2, vocabulary padding cut (pure torch)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import FAMILIES, MOE_FAMILY, randomize_norms_and_biases, tiny_config
from userrl_megatron.convert import Architecture, Converter, Split, TensorPlan, padded_vocab_size, shard, unshard
from userrl_megatron.sync.sender import _Packer
from userrl_megatron.wire.bucket import FlatBuffer, bucket_layout, unpack_bucket

VOCAB = 250  # padded to 256: padding rows at TP 1 and 2


def hf_state(family: str) -> tuple[Architecture, dict[str, torch.Tensor]]:
    config = tiny_config(family, vocab_size=VOCAB, num_hidden_layers=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms_and_biases(model)
    arch = Architecture.from_hf_config(config.to_dict())
    state = {k: v for k, v in model.state_dict().items() if ".mlp.experts." not in k}
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    for name in Converter(arch).hf_names():  # one tensor per expert projection, as HF checkpoints store them
        if ".mlp.experts." in name:
            state[name] = torch.randn((h, f) if "down_proj" in name else (f, h))
    return arch, state


def full_tensor_path(converter: Converter, name: str, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The export before plans: rebuild the full tensor, split it (q/k/v by GQA group, gate/up halves), copy
    each part out."""
    arch = converter.arch
    rule, at = converter.rule_for(name)
    full = unshard(shards, rule.split, rows=arch.vocab_size)
    if rule.hf[0].endswith(("q_proj.weight", "q_proj.bias")):
        rest = full.shape[1:]
        grouped = full.reshape(arch.num_kv_heads, (arch.heads_per_group + 2) * arch.head_dim, *rest)
        sizes = [arch.heads_per_group * arch.head_dim, arch.head_dim, arch.head_dim]
        parts = [p.reshape(-1, *rest) for p in torch.split(grouped, sizes, dim=1)]
    elif len(rule.hf) == 2:
        parts = list(torch.chunk(full, 2, dim=0))
    else:
        parts = [full]
    return [(h.format(**at), p.contiguous()) for h, p in zip(rule.hf, parts, strict=True)]


def megatron_shards(converter: Converter, state: dict[str, torch.Tensor], tp: int) -> dict[str, list[torch.Tensor]]:
    """Every Megatron tensor as TP shards; vocabulary padding rows hold garbage (the export must cut them)."""
    padded = padded_vocab_size(converter.arch.vocab_size, tp)
    out = {}
    for name, full in converter.hf_to_mcore(state).items():
        split = converter.split_of(name)
        shards = [shard(full, split, r, tp, padded_rows=padded).clone() for r in range(tp)]
        if split is Split.VOCAB:
            shards[-1][VOCAB - (tp - 1) * (padded // tp) :] = 7.0
        out[name] = shards
    return out


@pytest.mark.parametrize("family", [*FAMILIES, MOE_FAMILY])
@pytest.mark.parametrize("tp", [1, 2])
def test_bucket_filled_from_shards_equals_the_full_tensor_path(family: str, tp: int) -> None:
    arch, state = hf_state(family)
    converter = Converter(arch)
    packer, expected = _Packer(FlatBuffer()), {}
    for name, shards in megatron_shards(converter, state, tp).items():
        for hf_name, plan in converter.plans(name, shards):
            packer.add(hf_name, plan, 1 << 30)
        expected.update(full_tensor_path(converter, name, shards))
    names, dtypes, shapes = packer.metadata()
    received = dict(unpack_bucket(packer.flat(), bucket_layout(names, dtypes, shapes)))
    assert received.keys() == expected.keys() == state.keys()
    for hf_name, tensor in received.items():
        assert torch.equal(tensor, expected[hf_name]), hf_name
        assert torch.equal(tensor, state[hf_name]), hf_name
    assert received["model.embed_tokens.weight"].shape[0] == VOCAB


def test_plans_of_each_split_and_their_pieces() -> None:
    arch, state = hf_state("qwen2")
    converter = Converter(arch)
    shards = megatron_shards(converter, state, 2)
    pieces = {
        hf: (plan.shape, plan.dim, len(plan.pieces))
        for name in ("decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.mlp.linear_fc1.weight")
        for hf, plan in converter.plans(name, shards[name])
    }
    assert pieces == {
        "model.layers.0.self_attn.q_proj.bias": ((64,), 0, 2),
        "model.layers.0.self_attn.k_proj.bias": ((32,), 0, 2),
        "model.layers.0.self_attn.v_proj.bias": ((32,), 0, 2),
        "model.layers.0.mlp.gate_proj.weight": ((128, 64), 0, 2),
        "model.layers.0.mlp.up_proj.weight": ((128, 64), 0, 2),
    }
    [(_, down)] = converter.plans(
        "decoder.layers.1.mlp.linear_fc2.weight", shards["decoder.layers.1.mlp.linear_fc2.weight"]
    )
    assert (down.shape, down.dim) == ((64, 128), 1)
    [(_, embedding)] = converter.plans("embedding.word_embeddings.weight", shards["embedding.word_embeddings.weight"])
    assert [p.shape[0] for p in embedding.pieces] == [128, 122]  # 256 padded rows over TP 2, cut to 250
    [(_, norm)] = converter.plans("decoder.final_layernorm.weight", [state["model.norm.weight"]] * 2)
    assert len(norm.pieces) == 1  # replicated: the first rank's copy


def test_materialize_copies_only_what_it_must() -> None:
    weights = torch.arange(12.0).reshape(3, 4)
    kept = TensorPlan.of(weights).materialize()
    assert kept.data_ptr() == weights.data_ptr()  # a parameter is handed out as it is
    reused = TensorPlan((3, 4), (weights,), transient=True).materialize()
    assert reused.data_ptr() != weights.data_ptr() and torch.equal(reused, weights)  # gather memory is reused
    halves = TensorPlan((3, 4), (weights[:, :2], weights[:, 2:]), dim=1).materialize()
    assert torch.equal(halves, weights)
