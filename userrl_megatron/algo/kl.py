"""Per-token estimators of KL(π || π_ref) from log-probs of tokens sampled from π (Schulman, 2020)."""

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = log r, k2 = ½ (log r)², k3 = r⁻¹ − 1 + log r with log r = logπ − logπ_ref (k3: unbiased, ≥ 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
