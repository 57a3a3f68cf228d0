"""Advantage estimators: one value per token from per-turn rewards, grouped by task (GRPO).

`grpo_multiturn` follows UserRL (arXiv 2509.19736; https://github.com/SalesforceAIResearch/UserRL,
`verl/trainer/ppo/core_algos.py`): a trajectory score is normalised inside its group, then spread over the
trajectory's turns in proportion to per-turn credits, so the mean advantage over the tokens with non-zero credit
equals the normalised score. Per-turn quantities (a few per episode) are computed in
Python, exactly as the reference rounds them; everything per token is vectorised over the batch.
"""

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from userrl_megatron.config.schema import AlgoConfig

TURN_LEVELS = ("Equalized", "R2G", "EM")
TRAJECTORY_SCORES = ("Sum", "R2G")
EM_CURVATURE = 2.0


@dataclass
class AdvantageInputs:
    """What every estimator sees: per-turn rewards, the group of each trajectory, the turn of each token."""

    turn_rewards: Sequence[Sequence[float]]
    group_ids: Sequence[Hashable]
    turn_index: torch.Tensor  # [B, L] int, -1 where the token is not trained


AdvantageFn = Callable[[AdvantageInputs, AlgoConfig], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under `name` (the value of `algo.adv_estimator`)."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def compute_advantages(inputs: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """Run the estimator named by `cfg.adv_estimator`; returns float32 [B, L]."""
    if cfg.adv_estimator not in ADVANTAGE_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {cfg.adv_estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[cfg.adv_estimator](inputs, cfg)


def score_trajectory(rewards: Sequence[float], method: str, gamma: float) -> float:
    """`Sum`: the mean turn reward rounded to 4 decimals (0 without turns); `R2G`: the discounted return."""
    if method == "Sum":
        return round(sum(rewards) / len(rewards), 4) if rewards else 0.0
    if method == "R2G":
        return sum(r * gamma**t for t, r in enumerate(rewards))
    raise ValueError(f"trajectory_score must be one of {TRAJECTORY_SCORES}, got {method!r}")


def credit_turns(rewards: Sequence[float], method: str, gamma: float) -> list[float]:
    """Per-turn credit: `Equalized` 1 each; `R2G` reward-to-go; `EM` 0.5..1 exponential map (4 dp)."""
    if method == "Equalized":
        return [1.0] * len(rewards)
    if method == "R2G":
        credits, running = [], 0.0
        for r in reversed(rewards):
            running = r + gamma * running
            credits.append(running)
        return credits[::-1]
    if method == "EM":
        scale = 1.0 - math.exp(-EM_CURVATURE)
        return [round(0.5 + 0.5 * (1.0 - math.exp(-EM_CURVATURE * r)) / scale, 4) for r in rewards]
    raise ValueError(f"turn_level must be one of {TURN_LEVELS}, got {method!r}")


def group_normalize(
    scores: Sequence[float], group_ids: Sequence[Hashable], norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(score - group mean) / (unbiased group std + eps); a group of one uses mean 0 and std 1. float64 [B]."""
    if len(scores) != len(group_ids):
        raise ValueError(f"{len(scores)} scores but {len(group_ids)} group ids")
    index: dict[Hashable, int] = {}
    group = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    s = torch.tensor(list(scores), dtype=torch.float64)
    n = torch.bincount(group, minlength=len(index)).to(torch.float64)
    # Shift by the group minimum before summing, so a group of identical scores has exactly zero spread.
    low = torch.full((len(index),), float("inf"), dtype=torch.float64).scatter_reduce_(0, group, s, "amin")
    mean = low + torch.zeros(len(index), dtype=torch.float64).index_add_(0, group, s - low[group]) / n
    sq = torch.zeros(len(index), dtype=torch.float64).index_add_(0, group, (s - mean[group]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    single = n == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    centred = s - mean[group]
    return centred / (std[group] + eps) if norm_by_std else centred


def spread_over_tokens(credits: Sequence[Sequence[float]], turn_index: torch.Tensor) -> torch.Tensor:
    """Token value = credit of the token's turn; 0 where turn_index is -1 or names a turn without credit."""
    B = turn_index.shape[0]
    if len(credits) != B:
        raise ValueError(f"{len(credits)} credit lists for a batch of {B}")
    width = max((len(c) for c in credits), default=0)
    table = torch.zeros(B, width + 1, dtype=torch.float64)  # the last column stays 0
    for b, c in enumerate(credits):
        table[b, : len(c)] = torch.tensor(list(c), dtype=torch.float64)
    lengths = torch.tensor([len(c) for c in credits], dtype=torch.long)
    idx = turn_index.long()
    valid = (idx >= 0) & (idx < lengths[:, None])
    return table.gather(1, torch.where(valid, idx, width))


def grpo_multiturn_advantages(
    turn_rewards: list[list[float]],
    group_ids: list,
    turn_index: torch.Tensor,
    gamma: float,
    turn_level: str,
    trajectory_score: str,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """UserRL multi-turn GRPO advantages (arXiv 2509.19736, `compute_grpo_multiturn_advantage`), float32 [B, L].

    A token of turn t in trajectory b gets z_b · c_t · N_b / Σ_t' c_t' L_t', where z_b is the group-normalised
    trajectory score, c the turn credits, L_t the trained tokens of turn t and N_b the trained tokens with
    non-zero credit. A trajectory whose credits sum to zero gets zero advantage.
    """
    if turn_index.dim() != 2 or len(turn_rewards) != turn_index.shape[0]:
        raise ValueError(f"turn_index must be [B, L] with B = {len(turn_rewards)}, got {tuple(turn_index.shape)}")
    scores = [score_trajectory(r, trajectory_score, gamma) for r in turn_rewards]
    z = group_normalize(scores, group_ids, norm_by_std, eps)
    values = spread_over_tokens([credit_turns(r, turn_level, gamma) for r in turn_rewards], turn_index)
    total = values.sum(dim=1)
    count = (values != 0).sum(dim=1).to(torch.float64)
    factor = torch.where(total != 0, z * count / torch.where(total != 0, total, 1.0), 0.0)
    return (values * factor[:, None]).to(torch.float32)


@register_advantage("grpo_multiturn")
def _grpo_multiturn(inputs: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    return grpo_multiturn_advantages(
        [list(r) for r in inputs.turn_rewards],
        list(inputs.group_ids),
        inputs.turn_index,
        gamma=cfg.gamma,
        turn_level=cfg.turn_level,
        trajectory_score=cfg.trajectory_score,
        norm_by_std=cfg.norm_by_std,
        eps=cfg.eps,
    )


@register_advantage("grpo")
def _grpo_outcome(inputs: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """Outcome-only GRPO: the group-normalised episode return on every trained token."""
    z = group_normalize([sum(r) for r in inputs.turn_rewards], inputs.group_ids, cfg.norm_by_std, cfg.eps)
    trained = (inputs.turn_index >= 0).to(torch.float64)
    return (trained * z[:, None]).to(torch.float32)


def episode_advantages(
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[Hashable],
    turn_index: Sequence[Sequence[int]],
    cfg: AlgoConfig,
) -> list[list[float]]:
    """Advantages for ragged episodes (lists of per-token turn indices), returned ragged."""
    lengths = [len(t) for t in turn_index]
    padded = torch.full((len(lengths), max(lengths, default=0)), -1, dtype=torch.long)
    for b, t in enumerate(turn_index):
        padded[b, : len(t)] = torch.tensor(list(t), dtype=torch.long)
    adv = compute_advantages(AdvantageInputs(turn_rewards, group_ids, padded), cfg)
    return [adv[b, :n].tolist() for b, n in enumerate(lengths)]
