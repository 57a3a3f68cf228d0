"""Per-token estimators of KL(π || π_ref) from log-probs of tokens sampled from π (Schulman, 2020), and the KL
penalty the loss adds, as UserRL's (verl's) `kl_penalty` computes it."""

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
# UserRL's `low_var_kl` (k3) bounds each token's penalty to [-10, 10], which also stops its gradient there: a
# policy far from the reference (late in a run, or off-policy tokens) would otherwise give penalties of e^|log r|.
K3_PENALTY_BOUND = 10.0
# exp() of the log-ratio is taken within this bound: beyond it the penalty is clamped anyway (k3 reaches 10 at
# log r ≈ -2.6 and 11), and an overflowing exp would turn the zero gradient into NaN (0 · inf).
K3_LOG_RATIO_BOUND = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = log r, k2 = ½ (log r)², k3 = r⁻¹ − 1 + log r with log r = logπ − logπ_ref (k3: unbiased, ≥ 0);
    unbounded (metrics use it)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL penalty of the loss: `kl_estimate`, with k3 bounded to ±`K3_PENALTY_BOUND` (zero gradient
    outside) as in UserRL. Values and gradients equal UserRL's wherever its are finite."""
    if estimator != "k3":
        return kl_estimate(logprobs, ref_logprobs, estimator)
    log_ratio = (logprobs - ref_logprobs).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    value = torch.exp(-log_ratio) - 1.0 + log_ratio
    return value.clamp(-K3_PENALTY_BOUND, K3_PENALTY_BOUND)
