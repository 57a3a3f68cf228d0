"""Megatron log-probs equal the `transformers` model's under TP, PP, DP, TP x PP, TP=3 and interleaved PP
(the last two also train against the torch reference).

Tiny random Llama (tied embeddings, a vocabulary Megatron has to pad), Qwen2 (QKV bias) and Qwen3
(QK-norm) models with randomised norms and biases. Negative controls: a QKV mapping with K and V swapped
and a gate/up mapping with the halves swapped must be caught. Exported HF weights equal the originals.
"""

import dataclasses
from pathlib import Path

import pytest

from tests.support.distributed import (
    build_actor,
    hf_logprobs,
    init_world,
    max_abs_diff,
    megatron_config,
    random_batch,
    random_sequences,
    spawn,
)
from tests.support.tiny_models import make_tiny_model
from userrl_megatron.config.schema import AlgoConfig
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

TOL = 1e-5
LENGTHS = [5, 23, 9, 31, 2, 14]
FAMILIES = {
    "llama": {"tie_word_embeddings": True, "vocab_size": 250},
    "qwen2": {},
    "qwen3": {},
}
# TP=3 needs heads and KV heads divisible by 3; PP=3 x VPP=2 needs 6 layers.
TP3_MODEL = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "intermediate_size": 192,
    "num_hidden_layers": 6,
    "vocab_size": 250,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each family's model dir, test sequences and reference log-probs / entropies."""
    root = tmp_path_factory.mktemp("logprob_models")
    out = {}
    for family, overrides in FAMILIES.items():
        model_dir = make_tiny_model(family, root / family, seed=1, **overrides)
        seqs = random_sequences(overrides.get("vocab_size", 256), LENGTHS, seed=2)
        logprobs, entropy = hf_logprobs(model_dir, seqs, entropy=True)
        out[family] = {"dir": model_dir, "seqs": seqs, "logprobs": logprobs, "entropy": entropy}
    return out


def trained_half(seqs: list[list[int]]) -> list[list[int]]:
    """A loss mask training the second half of each sequence, and nothing of the third one."""
    return [[int(i != 2 and t >= len(s) // 2) for t in range(len(s))] for i, s in enumerate(seqs)]


def _compare(actor, model: dict) -> dict:
    logprobs, entropy = actor.compute_logprobs(TrainBatch(model["seqs"], [], []), with_entropy=True)
    mask = trained_half(model["seqs"])
    # Only the trained tokens: the output layer runs at their positions alone (the rest must be 0.0).
    trained = actor.compute_logprobs(TrainBatch(model["seqs"], mask, []), trained_only=True)
    expected = [[v * m for v, m in zip(lp, row, strict=True)] for lp, row in zip(model["logprobs"], mask, strict=True)]
    return {
        "logprobs": max_abs_diff(logprobs, model["logprobs"]),
        "entropy": max_abs_diff(entropy, model["entropy"]),
        "trained_only": max_abs_diff(trained, expected),
        "values": logprobs,
    }


def _export_matches(actor, model_dir: Path, out: Path) -> bool | None:
    """Rank 0: does the exported HF directory (each stage writing its own shards) equal the original bit for bit?"""
    import torch

    from userrl_megatron.convert.hf_io import HFWeights

    actor.export_hf_dir(str(out))
    stage = dict(actor.export_hf_weights())
    if actor.layout.is_stage_source:
        original = HFWeights(model_dir)
        assert all(torch.equal(t, original[n]) for n, t in stage.items()), "a stage exported a wrong tensor"
    if actor.layout.rank != 0:
        return None
    original, exported = HFWeights(model_dir), HFWeights(out)
    names = set(original.keys())
    return set(exported.keys()) == names and all(torch.equal(exported[k], original[k]) for k in names)


def _layouts_2(rank: int, world: int, port: int, models: dict) -> dict:
    out = {}
    for name, layout in {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2": {}}.items():
        cfg = megatron_config(micro_batch_tokens=48, **layout)
        init_world(rank, world, port, cfg)
        for family, model in models.items():
            actor = build_actor(model["dir"], cfg)
            out[(name, family)] = _compare(actor, model)
            export_dir = Path(model["dir"]).parent / f"export-{name}"
            out[(name, family, "export")] = _export_matches(actor, model["dir"], export_dir)
    out["negative"] = _negative_controls(rank, world, port, models["qwen2"])
    return out


def _negative_controls(rank: int, world: int, port: int, model: dict) -> dict:
    """Reload the TP=2 actor through deliberately wrong rules: the log-probs must move far from HF's."""
    from userrl_megatron.convert.hf_io import HFWeights
    from userrl_megatron.convert.rules import FAMILY_RULES, GATE_UP, QKV, Converter
    from userrl_megatron.megatron.model import HFSource, load_full_weights

    cfg = megatron_config(tp=2)
    layout = init_world(rank, world, port, cfg)
    actor = build_actor(model["dir"], cfg)
    wrong = {
        "kv_swapped": dataclasses.replace(QKV, hf=(QKV.hf[0], QKV.hf[2], QKV.hf[1])),
        "gate_up_swapped": dataclasses.replace(GATE_UP, hf=tuple(reversed(GATE_UP.hf))),
    }
    out = {}
    for name, bad_rule in wrong.items():
        rules = [bad_rule if r.mcore == bad_rule.mcore else r for r in FAMILY_RULES["qwen2"]]
        converter = Converter(actor.arch, rules=rules)
        source = HFSource(HFWeights(model["dir"]), converter)
        load_full_weights([c.module for c in actor.chunks], source, converter, layout.tp_rank, layout.tp)
        out[name] = _compare(actor, model)["logprobs"]
    return out


def test_tp2_pp2_dp2_match_transformers(models: dict) -> None:
    results = spawn(_layouts_2, 2, models)
    for layout in ("tp2", "pp2", "dp2"):
        for family in FAMILIES:
            r = results[0][(layout, family)]
            assert r["logprobs"] <= TOL, (layout, family, r["logprobs"])
            assert r["entropy"] <= TOL, (layout, family, r["entropy"])
            assert r["trained_only"] <= TOL, (layout, family, r["trained_only"])
            assert r["values"] == results[1][(layout, family)]["values"]  # identical on every rank
            assert results[0][(layout, family, "export")] is True
            assert results[1][(layout, family, "export")] is None
    negative = results[0]["negative"]
    assert negative["kv_swapped"] > 1e-2 and negative["gate_up_swapped"] > 1e-3, negative


def _layouts_4(rank: int, world: int, port: int, models: dict) -> dict:
    cfg = megatron_config(tp=2, pp=2, micro_batch_tokens=48)
    init_world(rank, world, port, cfg)
    out = {}
    for family, model in models.items():
        actor = build_actor(model["dir"], cfg)
        out[family] = _compare(actor, model)
        out[(family, "export")] = _export_matches(actor, model["dir"], Path(model["dir"]).parent / "export-tp2pp2")
    return out


def test_tp2_x_pp2_matches_transformers(models: dict) -> None:
    results = spawn(_layouts_4, 4, models)
    for family in FAMILIES:
        assert results[0][family]["logprobs"] <= TOL, (family, results[0][family]["logprobs"])
        assert results[0][family]["entropy"] <= TOL
        assert results[0][family]["trained_only"] <= TOL
        assert all(r[family]["values"] == results[0][family]["values"] for r in results)
        assert [r[(family, "export")] for r in results] == [True, None, None, None]


def _layouts_3(rank: int, world: int, port: int, model: dict, batches: list[TrainBatch]) -> dict:
    out = {}
    for name, layout in {"tp3": {"tp": 3}, "pp3_vpp2": {"pp": 3, "vpp": 2}}.items():
        cfg = megatron_config(micro_batch_tokens=40, **layout)
        init_world(rank, world, port, cfg)
        actor = build_actor(model["dir"], cfg)
        out[name] = _compare(actor, model)
        out[(name, "export")] = _export_matches(actor, model["dir"], Path(model["dir"]).parent / f"export-{name}")
        out[(name, "losses")] = [actor.train_step(b)["actor/loss"] for b in batches]
    return out


def test_tp3_and_interleaved_pp3_match_transformers_and_train(tmp_path: Path) -> None:
    from tests.support import reference

    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3_6h", seed=3, **TP3_MODEL)
    seqs = random_sequences(250, LENGTHS, seed=4)
    logprobs, entropy = hf_logprobs(model_dir, seqs, entropy=True)
    model = {"dir": model_dir, "seqs": seqs, "logprobs": logprobs, "entropy": entropy}
    batches = [random_batch(250, LENGTHS, seed=s) for s in range(2)]
    expected = [r["loss"] for r in reference.train(model_dir, batches, AlgoConfig(), megatron_config())]
    results = spawn(_layouts_3, 3, model, batches)
    for name in ("tp3", "pp3_vpp2"):
        assert results[0][name]["logprobs"] <= TOL, (name, results[0][name]["logprobs"])
        assert results[0][name]["entropy"] <= TOL
        assert results[0][name]["trained_only"] <= TOL
        assert all(r[name]["values"] == results[0][name]["values"] for r in results)
        assert results[0][(name, "export")] is True
        assert results[0][(name, "losses")] == pytest.approx(expected, abs=1e-5), name
