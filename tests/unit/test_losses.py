"""Policy loss, aggregation, KL and mismatch correction against hand-derived values and gradcheck."""

import math

import pytest
import torch

from userrl_megatron.algo import LossInputs, aggregate, compute_policy_loss, kl_estimate, kl_penalty
from userrl_megatron.algo.losses import mismatch_sums, ppo_clip_terms, truncated_is_weight
from userrl_megatron.config import AlgoConfig


def test_ppo_clip_terms_by_hand() -> None:
    # (advantage, ratio) -> loss with clip 0.2 (low) / 0.28 (high), dual clip c = 3
    cases = [
        (1.0, 1.5, -1.28, 1, 0),  # positive A, ratio above 1+eh: clipped to -(1.28)
        (1.0, 0.5, -0.5, 0, 0),  # positive A, ratio below: unclipped -0.5 (the max)
        (-1.0, 0.5, 0.8, 1, 0),  # negative A, ratio below 1-el: clipped to 0.8
        (-1.0, 2.0, 2.0, 0, 0),  # negative A, ratio 2: unclipped 2.0 (< dual bound 3)
        (-1.0, 5.0, 3.0, 0, 1),  # negative A, ratio 5: dual-clipped to 3
        (2.0, 1.1, -2.2, 0, 0),  # inside the trust region
    ]
    adv = torch.tensor([c[0] for c in cases])
    logp = torch.log(torch.tensor([c[1] for c in cases]))
    loss, clipped, dual = ppo_clip_terms(logp, torch.zeros_like(logp), adv, 0.2, 0.28, 3.0)
    assert loss.tolist() == pytest.approx([c[2] for c in cases], abs=1e-6)
    assert clipped.tolist() == [c[3] for c in cases]
    assert dual.tolist() == [c[4] for c in cases]
    no_dual, _, _ = ppo_clip_terms(logp, torch.zeros_like(logp), adv, 0.2, 0.28, 0.0)
    assert no_dual[4].item() == pytest.approx(5.0)


def test_gradient_matches_hand_derivation() -> None:
    # d/dlogp of -A·ρ is -A·ρ on unclipped tokens and 0 on clipped ones; token-mean divides by trained tokens.
    logp = torch.log(torch.tensor([[1.1, 1.5, 0.9, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = compute_policy_loss(LossInputs(logp, torch.zeros_like(logp), adv, mask), AlgoConfig())
    out.loss.backward()
    expected = torch.tensor([[-1.0 * 1.1, 0.0, 2.0 * 0.9, 0.0]]) / 3
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert out.loss.item() == pytest.approx((-1.1 - 1.2 + 1.8) / 3, abs=1e-6)
    means = out.means()
    assert means["actor/clip_frac"] == pytest.approx(1 / 3)
    assert means["actor/pg_loss"] == pytest.approx((-1.1 - 1.2 + 1.8) / 3, abs=1e-6)


def test_gradcheck_full_loss() -> None:
    torch.manual_seed(0)
    B, L = 3, 5
    old = -torch.rand(B, L, dtype=torch.float64) - 0.5
    logp = (old + 0.05 * torch.randn(B, L, dtype=torch.float64)).requires_grad_()  # inside the clip range
    ref = old + 0.1 * torch.randn(B, L, dtype=torch.float64)
    ent = (torch.rand(B, L, dtype=torch.float64) + 0.5).requires_grad_()
    adv = torch.randn(B, L, dtype=torch.float64)
    mask = (torch.rand(B, L) > 0.3).double()
    mask[:, 0] = 1
    for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        cfg = AlgoConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, loss_agg=agg)

        def f(lp: torch.Tensor, e: torch.Tensor, cfg: AlgoConfig = cfg) -> torch.Tensor:
            return compute_policy_loss(LossInputs(lp, old, adv, mask, ref_logprobs=ref, entropy=e), cfg).loss

        assert torch.autograd.gradcheck(f, (logp, ent))


def test_aggregation_modes_by_hand() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(per_token, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(per_token, mask, "token-mean", normalizer=7.0).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        aggregate(per_token, mask, "sum")


def test_global_normalizer_makes_micro_batches_add_up() -> None:
    torch.manual_seed(1)
    logp, old, adv = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    mask = (torch.rand(6, 4) > 0.4).float()
    cfg = AlgoConfig(clip_low=10, clip_high=10)
    full = compute_policy_loss(LossInputs(logp, old, adv, mask), cfg).loss
    n = float(mask.sum())
    parts = [
        compute_policy_loss(LossInputs(logp[s], old[s], adv[s], mask[s]), cfg, n).loss
        for s in (slice(0, 2), slice(2, 6))
    ]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-6)


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = 1
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1.0))  # e^-1 - 1 + 1
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl estimator must be one of"):
        kl_estimate(logp, ref, "k4")


def userrl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """UserRL's (verl's) `kl_penalty` as its core_algos.py computes it, for reference."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    kl = ref_logprob - logprob
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("drift", [0.05, 1.0, 4.0, 30.0])  # spread of log π − log π_ref, nats
def test_kl_penalty_matches_userrl_in_value_and_gradient(estimator: str, drift: float) -> None:
    generator = torch.Generator().manual_seed(int(drift * 100))
    ref = -torch.rand(64, 48, generator=generator, dtype=torch.float64) * 8
    logp = ref + torch.randn(64, 48, generator=generator, dtype=torch.float64) * drift
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    value = kl_penalty(ours, ref, estimator)
    expected = userrl_kl_penalty(theirs, ref, estimator)
    weights = torch.rand(64, 48, generator=generator, dtype=torch.float64)  # any downstream use of the penalty
    (value * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(value.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    if estimator == "k3" and drift >= 4.0:  # drifted tokens are bounded and pass no gradient
        bounded = value.detach() == 10.0
        assert bounded.any() and (ours.grad[bounded] == 0).all()


def test_a_drifted_policy_keeps_the_k3_penalty_bounded() -> None:
    # The policy 30 nats below the reference on every token: unbounded, k3 is e^30 ≈ 1e13 per token.
    logp = torch.full((2, 5), -40.0, requires_grad=True)
    ref = torch.full((2, 5), -10.0)
    assert kl_estimate(logp.detach(), ref, "k3").min().item() > 1e13  # the metric's estimate stays unbounded
    cfg = AlgoConfig(kl_coef=0.1, kl_estimator="k3")
    out = compute_policy_loss(
        LossInputs(logp, logp.detach(), torch.zeros(2, 5), torch.ones(2, 5), ref_logprobs=ref), cfg
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1 * 10.0)  # zero advantages: the penalty alone, at its bound
    assert out.token_sums["actor/kl_ref"].item() == pytest.approx(10 * 10.0)
    assert torch.equal(logp.grad, torch.zeros(2, 5))  # bounded, so no gradient (and no NaN from exp overflow)
    far = torch.full((1,), -200.0, requires_grad=True)  # exp(200) overflows; the penalty and gradient do not
    kl_penalty(far, torch.zeros(1), "k3").sum().backward()
    assert far.grad is not None and far.grad.item() == 0.0


def test_kl_penalty_needs_reference() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs reference log-probs"):
        compute_policy_loss(LossInputs(x, x, x, torch.ones(1, 2)), AlgoConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs per-token entropy"):
        compute_policy_loss(LossInputs(x, x, x, torch.ones(1, 2)), AlgoConfig(entropy_coef=0.1))


def test_truncated_importance_sampling_and_mismatch_metrics() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -0.5, -1.0]])  # π_old/π_rollout = e^0.5, e^-0.5, 1
    w = truncated_is_weight(old, rollout, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-0.5), 1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    sums = mismatch_sums(old, rollout, mask)
    assert sums["mismatch/abs_logprob_diff"].item() == pytest.approx(1.0)
    k3 = lambda d: math.exp(-d) - 1 + d  # noqa: E731  (rollout - old = d)
    assert sums["mismatch/kl"].item() == pytest.approx(k3(-0.5) + k3(0.5))

    # With TIS on, each token's policy-gradient term is scaled by its weight.
    logp = old.clone().requires_grad_()
    adv = torch.ones(1, 3)
    cfg = AlgoConfig(tis_cap=1.5)
    out = compute_policy_loss(LossInputs(logp, old, adv, mask, rollout_logprobs=rollout), cfg)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 2, -math.exp(-0.5) / 2, 0.0])
    assert out.means()["tis/weight"] == pytest.approx((1.5 + math.exp(-0.5)) / 2)
    assert out.means()["tis/clip_frac"] == pytest.approx(1 / 2)  # the first token's weight e^0.5 > 1.5 is cut
