"""Policy losses over per-token log-probs of padded episodes ([B, L], loss on masked tokens only).

A loss returns a scalar already divided by its normaliser. The actor passes the global normaliser (trained
tokens, or sequences, summed over every micro-batch and data-parallel rank) so that summing micro-batch
losses gives the loss of the whole mini-batch, whatever the micro-batching. Metrics come back as sums over
tokens, so the caller can add them across micro-batches and ranks before dividing by the token count.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from userrl_megatron.algo.kl import kl_estimate, kl_penalty
from userrl_megatron.config.schema import AlgoConfig

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all [B, L]; optional ones may be None."""

    logprobs: torch.Tensor  # current policy (requires grad)
    old_logprobs: torch.Tensor  # policy that generated the data, recomputed by the trainer
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on trained tokens
    ref_logprobs: torch.Tensor | None = None  # reference policy, for the KL penalty
    rollout_logprobs: torch.Tensor | None = None  # what the rollout engine reported, for mismatch correction
    entropy: torch.Tensor | None = None  # per-token entropy of the current policy


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, normalised
    token_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # detached per-token metric sums
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))

    def means(self) -> dict[str, float]:
        """Token means of the metrics (for a single micro-batch)."""
        n = max(float(self.num_tokens), 1.0)
        return {k: float(v) / n for k, v in self.token_sums.items()}


PolicyLossFn = Callable[[LossInputs, AlgoConfig, float | None], LossOutput]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `name` (the value of `algo.policy_loss`)."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def compute_policy_loss(inputs: LossInputs, cfg: AlgoConfig, normalizer: float | None = None) -> LossOutput:
    """Run the loss named by `cfg.policy_loss`. `normalizer` defaults to this micro-batch's own count."""
    if cfg.policy_loss not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {cfg.policy_loss!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[cfg.policy_loss](inputs, cfg, normalizer)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce a [B, L] per-token loss to a scalar.

    token-mean: Σ loss / trained tokens; seq-mean-token-sum: Σ_seq Σ_tok loss / sequences;
    seq-mean-token-mean: Σ_seq mean_tok loss / sequences. `normalizer` replaces the denominator.
    """
    masked = per_token * mask
    if mode == "token-mean":
        total, default = masked.sum(), mask.sum()
    elif mode == "seq-mean-token-sum":
        total, default = masked.sum(), torch.tensor(float(mask.shape[0]))
    elif mode == "seq-mean-token-mean":
        total = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
        default = torch.tensor(float(mask.shape[0]))
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    denom = normalizer if normalizer is not None else default.clamp(min=1)
    return total / denom


def ppo_clip_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate max(−Aρ, −A·clip(ρ, 1−εl, 1+εh)), dual-clipped at −c·A for A < 0.

    Returns (loss, clipped, dual_clipped) where the last two are 0/1 indicators for metrics.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    dual_clipped = torch.zeros_like(loss)
    if dual_clip_c > 1.0:
        bound = -advantages * dual_clip_c
        negative = advantages < 0
        dual_clipped = (negative & (loss > bound)).float()
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return loss, was_clipped, dual_clipped


def truncated_is_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(π_old / π_rollout, cap), detached: corrects for the engine sampling a different policy (numerical
    mismatch, or older weights in the asynchronous rollout modes, where π_old is the trainer's policy at the update)."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def mismatch_sums(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Token sums of |Δ log p| and of the k3 KL estimate between the trainer's and the engine's log-probs."""
    diff = (old_logprobs - rollout_logprobs).abs() * mask
    kl = kl_estimate(rollout_logprobs, old_logprobs, "k3") * mask
    return {"mismatch/abs_logprob_diff": diff.sum(), "mismatch/kl": kl.sum()}


@register_policy_loss("ppo_clip")
def ppo_clip_loss(inputs: LossInputs, cfg: AlgoConfig, normalizer: float | None = None) -> LossOutput:
    """PPO clipped surrogate (separate low/high clip, dual clip) + KL penalty − entropy bonus, optional TIS."""
    mask = inputs.mask.to(inputs.logprobs.dtype)
    pg, clipped, dual = ppo_clip_terms(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    )
    sums: dict[str, torch.Tensor] = {}
    if cfg.tis_cap > 0 and inputs.rollout_logprobs is not None:
        weight = truncated_is_weight(inputs.old_logprobs, inputs.rollout_logprobs, cfg.tis_cap)
        pg = pg * weight
        sums["tis/weight"] = (weight * mask).sum()
        sums["tis/clip_frac"] = ((weight >= cfg.tis_cap).float() * mask).sum()  # tokens whose weight was truncated
    per_token = pg
    if cfg.kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("algo.kl_coef > 0 needs reference log-probs")
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        sums["actor/kl_ref"] = (kl.detach() * mask).sum()
    if inputs.entropy is not None:
        sums["actor/entropy"] = (inputs.entropy.detach() * mask).sum()
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * inputs.entropy
    elif cfg.entropy_coef > 0:
        raise ValueError("algo.entropy_coef > 0 needs per-token entropy")
    loss = aggregate(per_token, mask, cfg.loss_agg, normalizer)

    with torch.no_grad():
        log_ratio = inputs.logprobs - inputs.old_logprobs
        sums["actor/pg_loss"] = (pg * mask).sum()
        sums["actor/clip_frac"] = (clipped * mask).sum()
        sums["actor/dual_clip_frac"] = (dual * mask).sum()
        sums["actor/ppo_kl"] = (kl_estimate(inputs.old_logprobs, inputs.logprobs, "k3") * mask).sum()
        sums["actor/ratio"] = (torch.exp(log_ratio) * mask).sum()
        sums["actor/advantage"] = (inputs.advantages * mask).sum()
        if inputs.rollout_logprobs is not None:
            sums.update(mismatch_sums(inputs.old_logprobs, inputs.rollout_logprobs, mask))
    return LossOutput(loss=loss, token_sums={k: v.detach() for k, v in sums.items()}, num_tokens=mask.sum().detach())


@register_policy_loss("sft_nll")
def sft_nll_loss(inputs: LossInputs, cfg: AlgoConfig, normalizer: float | None = None) -> LossOutput:
    """Supervised fine-tuning: the negative log-likelihood of the masked (assistant) tokens, aggregated by
    `cfg.loss_agg` (`userrl sft` uses token-mean: Σ NLL / trained tokens of the whole batch). Advantages and
    old log-probs are ignored."""
    mask = inputs.mask.to(inputs.logprobs.dtype)
    nll = -inputs.logprobs
    loss = aggregate(nll, mask, cfg.loss_agg, normalizer)
    sums = {"sft/nll": (nll.detach() * mask).sum()}
    if inputs.entropy is not None:
        sums["actor/entropy"] = (inputs.entropy.detach() * mask).sum()
    return LossOutput(loss=loss, token_sums=sums, num_tokens=mask.sum().detach())
