"""From rollout groups to the actor's TrainBatch: filters, advantages, masks, and the batch's own metrics."""

import random
from dataclasses import dataclass, field

import numpy as np

from userrl_megatron.algo.advantages import episode_advantages
from userrl_megatron.config.schema import AlgoConfig
from userrl_megatron.types import Episode, EpisodeGroup, TrainBatch

# Episodes that never produced a usable trajectory: always dropped.
BROKEN = ("engine_error",)


@dataclass
class Prepared:
    """What survives the filters, ready for log-probs and updates."""

    episodes: list[Episode]
    batch: TrainBatch  # advantages filled in; old/ref log-probs filled in later
    metrics: dict[str, float] = field(default_factory=dict)


def filter_groups(groups: list[EpisodeGroup], algo: AlgoConfig) -> tuple[list[EpisodeGroup], dict[str, float]]:
    """Drop broken episodes, user-simulator failures (when `algo.user_sim_failure` is "drop") and, optionally,
    groups whose returns are all equal (their advantages are zero: no learning signal, only cost)."""
    kept, dropped_episodes, dropped_groups = [], 0, 0
    for group in groups:
        trained = trainable_part(group, algo)
        dropped_episodes += len(group.episodes) - len(trained.episodes)
        if not trained.episodes or (algo.drop_equal_score_groups and not trained.has_signal):
            dropped_groups += 1
            continue
        kept.append(trained)
    metrics = {"batch/dropped_episodes": float(dropped_episodes), "batch/dropped_groups": float(dropped_groups)}
    return kept, metrics


def trainable_part(group: EpisodeGroup, algo: AlgoConfig) -> EpisodeGroup:
    """The group without the episodes training drops (broken ones; user-simulator failures when
    `algo.user_sim_failure` is "drop"): what its scores, and so its signal, are computed over."""
    return EpisodeGroup(group.group_id, group.task, [e for e in group.episodes if not _dropped(e, algo)])


def bound_staleness(
    groups: list[EpisodeGroup], version: int, max_staleness: int | None
) -> tuple[list[EpisodeGroup], dict[str, float]]:
    """With a bound, drop the groups whose stalest turn lags more than `max_staleness` versions behind `version`
    (the trainer's weights) whole: GRPO normalises within a group, so a group is kept or dropped as one. The
    metrics: the staleness of the kept groups' turns (mean, max) and the count of groups dropped."""
    metrics: dict[str, float] = {}
    if max_staleness is not None:
        kept = [
            g for g in groups if all(version - t.weight_version <= max_staleness for e in g.episodes for t in e.turns)
        ]
        metrics["batch/stale_groups"] = float(len(groups) - len(kept))
        groups = kept
    lags = [version - t.weight_version for g in groups for e in g.episodes for t in e.turns]
    if lags:
        metrics |= {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags))}
    return groups, metrics


def prepare_batch(groups: list[EpisodeGroup], algo: AlgoConfig) -> Prepared | None:
    """Advantages per token (the configured estimator, normalised within each group) and the TrainBatch.

    Episodes with a user-simulator failure under `user_sim_failure: mask` stay in their group's statistics but
    carry no loss. Returns None when nothing is left to train on.
    """
    groups, metrics = filter_groups(groups, algo)
    episodes = [e for g in groups for e in g.episodes]
    if not episodes:
        return None
    advantages = episode_advantages(
        [e.turn_rewards for e in episodes], [e.group_id for e in episodes], [e.turn_index for e in episodes], algo
    )
    masks = [[0] * len(e.loss_mask) if _masked(e, algo) else list(e.loss_mask) for e in episodes]
    batch = TrainBatch(
        token_ids=[list(e.token_ids) for e in episodes],
        loss_mask=masks,
        advantages=advantages,
        rollout_logprobs=[list(e.rollout_logprobs) for e in episodes],
        turn_versions=[[t.weight_version for t in e.turns] for e in episodes],
        routed_experts=_routed_experts(episodes),
    )
    metrics["batch/masked_episodes"] = float(sum(_masked(e, algo) for e in episodes))
    metrics["batch/episodes"] = float(len(episodes))
    metrics["batch/trained_tokens"] = float(batch.num_trained_tokens)
    trained = [a for adv, m in zip(advantages, masks, strict=True) for a, keep in zip(adv, m, strict=True) if keep]
    if trained:
        metrics["batch/advantage_abs_mean"] = sum(abs(a) for a in trained) / len(trained)
    return Prepared(episodes, batch, metrics)


def mini_batches(batch: TrainBatch, count: int, seed: int) -> list[TrainBatch]:
    """Split the episodes into `count` mini-batches (one optimizer step each), shuffled with `seed`."""
    order = list(range(len(batch)))
    random.Random(seed).shuffle(order)
    parts = [order[i::count] for i in range(count)]
    return [_select(batch, sorted(part)) for part in parts if part]


def _select(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    def pick(values: list[list] | None) -> list[list] | None:
        return None if values is None else [values[i] for i in rows]

    return TrainBatch(
        token_ids=[batch.token_ids[i] for i in rows],
        loss_mask=[batch.loss_mask[i] for i in rows],
        advantages=[batch.advantages[i] for i in rows],
        old_logprobs=pick(batch.old_logprobs),
        ref_logprobs=pick(batch.ref_logprobs),
        rollout_logprobs=pick(batch.rollout_logprobs),
        turn_versions=pick(batch.turn_versions),
        routed_experts=pick(batch.routed_experts),
    )


def _routed_experts(episodes: list[Episode]) -> list[np.ndarray] | None:
    """Each episode's recorded engine routing as one int32 [n, layers x top_k] array; None without replay."""
    if not any(e.routed_experts for e in episodes):
        return None
    return [np.concatenate(e.routed_experts) if e.routed_experts else np.zeros((0, 0), np.int32) for e in episodes]


def _dropped(episode: Episode, algo: AlgoConfig) -> bool:
    if episode.finish_reason in BROKEN or not episode.turns:
        return True
    return episode.finish_reason == "user_sim_error" and algo.user_sim_failure == "drop"


def _masked(episode: Episode, algo: AlgoConfig) -> bool:
    return episode.finish_reason == "user_sim_error" and algo.user_sim_failure == "mask"
