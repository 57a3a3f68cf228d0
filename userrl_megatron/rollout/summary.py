"""Rollout statistics: a per-gym summary table (`userrl rollout`) and flat metrics for the tracker (trainer).

Episodes lost to the infrastructure (an engine error, a failed user-simulator call) say nothing about the
policy: they are counted (`infra_failed`) and left out of every score and length statistic.
"""

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from userrl_megatron.types import Episode

INFRA_FAILURES = ("engine_error", "user_sim_error")


def is_infra_failure(episode: Episode) -> bool:
    """Did the infrastructure (engine, user simulator), not the policy, end this episode?"""
    return episode.finish_reason in INFRA_FAILURES


@dataclass
class GymSummary:
    """Aggregates over the episodes of one gym (or of all gyms, gym = "all")."""

    gym: str
    episodes: int
    infra_failed: int  # episodes ended by the infrastructure: excluded from the statistics below
    reward_mean: float  # mean episode return (sum of turn rewards)
    positive: float  # fraction of episodes with a positive return
    turns_mean: float
    generated_tokens: int  # trained (policy-generated) tokens
    response_tokens_mean: float  # tokens after the prompt, generated and environment ones
    finish: dict[str, int] = field(default_factory=dict)  # finish reason -> episodes


def summarize(episodes: Iterable[Episode]) -> list[GymSummary]:
    """One row per gym, sorted by name, then the "all" row."""
    by_gym: dict[str, list[Episode]] = defaultdict(list)
    everything = []
    for episode in episodes:
        by_gym[episode.task.gym].append(episode)
        everything.append(episode)
    rows = [_summary(gym, by_gym[gym]) for gym in sorted(by_gym)]
    return [*rows, _summary("all", everything)] if everything else []


def rollout_metrics(episodes: Iterable[Episode], prefix: str = "rollout/") -> dict[str, float]:
    """Flat metrics: overall means, the share of each finish reason, and each gym's mean return."""
    rows = summarize(episodes)
    if not rows:
        return {}
    total = rows[-1]
    metrics = {
        f"{prefix}episodes": float(total.episodes),
        f"{prefix}infra_failed": float(total.infra_failed),
        f"{prefix}generated_tokens": float(total.generated_tokens),
    }
    if total.episodes > total.infra_failed:  # no score at all beats a score of 0 that nobody earned
        metrics |= {
            f"{prefix}reward_mean": total.reward_mean,
            f"{prefix}positive": total.positive,
            f"{prefix}turns_mean": total.turns_mean,
            f"{prefix}response_tokens_mean": total.response_tokens_mean,
        }
    metrics.update({f"{prefix}finish/{reason}": n / total.episodes for reason, n in total.finish.items()})
    metrics.update({f"{prefix}{r.gym}/reward_mean": r.reward_mean for r in rows[:-1] if r.episodes > r.infra_failed})
    return metrics


def _summary(gym: str, episodes: list[Episode]) -> GymSummary:
    scored = [e for e in episodes if not is_infra_failure(e)]
    n = max(len(scored), 1)
    return GymSummary(
        gym=gym,
        episodes=len(episodes),
        infra_failed=len(episodes) - len(scored),
        reward_mean=sum(e.total_reward for e in scored) / n,
        positive=sum(e.total_reward > 0 for e in scored) / n,
        turns_mean=sum(len(e.turns) for e in scored) / n,
        generated_tokens=sum(sum(e.loss_mask) for e in episodes),
        response_tokens_mean=sum(len(e.token_ids) - e.prompt_length for e in scored) / n,
        finish=dict(sorted(Counter(str(e.finish_reason) for e in episodes).items())),
    )
