"""Qwen3-MoE under Megatron on gloo: log-probs equal `transformers`' at TP1/EP1, EP=2, TP=2 (and TP2 x EP2), one
optimizer step lands on the same weights at EP=1 and EP=2, and the load-balancing loss has the value and the
gradient computed by hand from HF's router logits, whatever the micro-batch split and data-parallel size.

Training under TP > 1 is not tested: Megatron refuses MoE + TP without sequence parallelism, which needs
Transformer Engine or apex norms (GPU).

The tiny model has 8 experts, top-2 routing with renormalised weights (`norm_topk_prob`, as Qwen3-30B-A3B), and
router weights large enough that routing does not hang on rounding noise.
"""

from pathlib import Path

import pytest
import torch

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
from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from userrl_megatron.types import TrainBatch

pytestmark = pytest.mark.distributed

TOL = 1e-5
LENGTHS = [17, 9, 30, 5]
AUX_COEF = 0.5  # large, so that the aux-loss gradient is far above fp32 noise
# (name, megatron overrides, train) laid out in turn on the same 2 processes
LAYOUTS_2 = [
    ("tp1_ep1_dp2", {}, True),
    ("tp1_ep2_dp2", {"expert_model_parallel_size": 2}, True),
    ("tp2_ep1", {"tp": 2}, False),
]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model_dir = make_tiny_model(MOE_FAMILY, tmp_path_factory.mktemp("moe") / "qwen3_moe", seed=3)
    seqs = random_sequences(256, LENGTHS, seed=1)
    return {"dir": model_dir, "seqs": seqs, "logprobs": hf_logprobs(model_dir, seqs)}


def _layouts(rank: int, world: int, port: int, model_dir: str, seqs: list[list[int]], layouts: list) -> dict:
    """Per layout: log-probs, then (when `train`) one train step's metrics and the log-probs after it."""
    out = {}
    batch = random_batch(256, LENGTHS, seed=4)
    for name, overrides, train in layouts:
        cfg = megatron_config(devices_per_node=world, moe_aux_loss_coef=0.0, **overrides)
        init_world(rank, world, port, cfg)
        actor = build_actor(Path(model_dir), cfg)
        out[name] = {"before": actor.compute_logprobs(TrainBatch(seqs, [], []))}
        if train:
            out[name]["metrics"] = actor.train_step(batch)
            out[name]["after"] = actor.compute_logprobs(TrainBatch(seqs, [], []))
    return out


def _aux_probe(
    rank: int, world: int, port: int, model_dir: str, seqs: list[list[int]], budget: int, ep: int, tp: int
) -> dict:
    """A step whose advantages are all zero: the policy loss has no gradient, so the gradient norm is the aux
    loss's alone."""
    cfg = megatron_config(
        devices_per_node=world,
        expert_model_parallel_size=ep,
        tp=tp,
        moe_aux_loss_coef=AUX_COEF,
        grad_clip=0.0,
        micro_batch_tokens=budget,
    )
    init_world(rank, world, port, cfg)
    actor = build_actor(Path(model_dir), cfg)
    mask = [[0] + [1] * (len(s) - 1) for s in seqs]
    zeros = [[0.0] * len(s) for s in seqs]
    return actor.train_step(TrainBatch(seqs, mask, zeros, old_logprobs=zeros))


def hf_aux_loss(model_dir: Path, groups: list[list[list[int]]], top_k: int) -> tuple[float, float]:
    """(Σ_layers of the mean over micro-batches of Megatron's aux loss, the gradient norm of AUX_COEF times
    Σ_layers of its token-weighted mean), from HF's router logits. A micro-batch's aux loss of one layer is
    E · Σ_e f_e P_e over its real tokens, with f_e the fraction of the top-k slots routed to expert e and P_e its
    mean router probability (HF's formula divided by top-k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, weighted = torch.zeros(()), torch.zeros(())
    tokens = sum(len(s) for g in groups for s in g)
    for group in groups:
        logits = [model(torch.tensor([s]), output_router_logits=True).router_logits for s in group]
        for layer in range(len(logits[0])):
            layer_logits = torch.cat([per_seq[layer] for per_seq in logits])
            probs = torch.softmax(layer_logits.float(), dim=-1)
            experts = probs.shape[-1]
            chosen = torch.topk(probs, top_k, dim=-1).indices
            f = torch.bincount(chosen.reshape(-1), minlength=experts).float() / (chosen.numel())
            aux = experts * (f * probs.mean(0)).sum()
            total = total + aux.detach()
            weighted = weighted + aux * len(layer_logits) / tokens
    (AUX_COEF * weighted).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(total) / len(groups), float(norm)


def test_logprobs_match_transformers_and_one_step_matches_across_layouts(moe: dict) -> None:
    results = spawn(_layouts, 2, str(moe["dir"]), moe["seqs"], LAYOUTS_2)
    for rank_result in results:
        for name, _, _ in LAYOUTS_2:
            assert max_abs_diff(rank_result[name]["before"], moe["logprobs"]) <= TOL, name  # measured 9.5e-7
    ref = results[0]["tp1_ep1_dp2"]
    for name in ["tp1_ep2_dp2"]:
        got = results[0][name]
        assert max_abs_diff(got["after"], ref["after"]) <= TOL, name
        assert got["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-5)
        assert got["metrics"]["actor/loss"] == pytest.approx(ref["metrics"]["actor/loss"], rel=1e-5)
    assert max_abs_diff(ref["after"], ref["before"]) > 1e-3  # the step did change the model
    assert "actor/moe_aux_loss" not in ref["metrics"]  # coefficient 0: no aux loss


@pytest.mark.slow
def test_tp2_ep2_on_four_ranks(moe: dict) -> None:
    layouts = [
        ("tp2_ep2", {"tp": 2, "expert_model_parallel_size": 2}, False),
        ("ep4", {"expert_model_parallel_size": 4}, True),
    ]
    results = spawn(_layouts, 4, str(moe["dir"]), moe["seqs"], layouts)
    for rank_result in results:
        assert max_abs_diff(rank_result["tp2_ep2"]["before"], moe["logprobs"]) <= TOL
        assert max_abs_diff(rank_result["ep4"]["before"], moe["logprobs"]) <= TOL


@pytest.mark.parametrize(
    ("world", "tp", "ep", "budget", "groups"),
    [
        # lengths 30 | 17 | 9 + 5 (a padded micro-batch costs rows x longest; padding is kept out of the statistics)
        (1, 1, 1, 32, [[2], [0], [1, 3]]),
        # 30 + 17 + 9 + 5 in one micro-batch
        (1, 1, 1, 128, [[2, 0, 1, 3]]),
        # two data-parallel ranks, the experts split over them: rank 0 gets 30, rank 1 gets 17 + 9 + 5
        (2, 1, 2, 64, [[2], [0, 1, 3]]),
    ],
)
def test_aux_loss_value_and_gradient_match_hand_computation(
    moe: dict, world: int, tp: int, ep: int, budget: int, groups: list[list[int]]
) -> None:
    seqs = moe["seqs"]
    metrics = spawn(_aux_probe, world, str(moe["dir"]), seqs, budget, ep, tp)[0]
    want_loss, want_norm = hf_aux_loss(moe["dir"], [[seqs[i] for i in g] for g in groups], top_k=2)
    assert metrics["actor/moe_aux_loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert metrics["actor/loss"] == 0.0


def _resume(rank: int, world: int, port: int, model_dir: str, seqs: list[list[int]], root: str) -> dict:
    """Train, save, train again (EP2); a fresh EP2 actor resumes the save (weights and Adam) and takes the same
    second step; a fresh EP1 actor loads the weights alone and scores like the saved model."""
    batch = random_batch(256, LENGTHS, seed=5)
    out = {}
    for name, ep, load in [("saved", 2, None), ("resumed", 2, True), ("weights_ep1", 1, False)]:
        cfg = megatron_config(devices_per_node=world, expert_model_parallel_size=ep, moe_aux_loss_coef=AUX_COEF)
        init_world(rank, world, port, cfg)
        actor = build_actor(Path(model_dir), cfg)
        if load is None:
            actor.train_step(batch)
            actor.save(f"{root}/step_1", {})
            out[name] = {"step_1": actor.compute_logprobs(TrainBatch(seqs, [], []))}
        else:
            actor.load(f"{root}/step_1", with_optimizer=load)
            out[name] = {"step_1": actor.compute_logprobs(TrainBatch(seqs, [], []))}
            if not load:
                continue
        out[name]["metrics"] = actor.train_step(batch)
        out[name]["step_2"] = actor.compute_logprobs(TrainBatch(seqs, [], []))
    return out


def test_checkpoint_under_ep2_resumes_and_its_weights_load_under_ep1(moe: dict, tmp_path: Path) -> None:
    result = spawn(_resume, 2, str(moe["dir"]), moe["seqs"], str(tmp_path))[0]
    saved, resumed, ep1 = result["saved"], result["resumed"], result["weights_ep1"]
    assert max_abs_diff(resumed["step_1"], saved["step_1"]) == 0.0
    assert max_abs_diff(ep1["step_1"], saved["step_1"]) <= TOL
    assert max_abs_diff(resumed["step_2"], saved["step_2"]) <= TOL
    assert resumed["metrics"]["actor/grad_norm"] == pytest.approx(saved["metrics"]["actor/grad_norm"], rel=1e-5)
    assert resumed["metrics"]["actor/moe_aux_loss"] == pytest.approx(saved["metrics"]["actor/moe_aux_loss"], rel=1e-5)
