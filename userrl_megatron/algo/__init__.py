"""The RL algorithm in pure torch: advantage estimators (registry), policy losses (registry), KL estimators."""

from userrl_megatron.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    credit_turns,
    episode_advantages,
    group_normalize,
    grpo_multiturn_advantages,
    register_advantage,
    score_trajectory,
)
from userrl_megatron.algo.kl import kl_estimate, kl_penalty
from userrl_megatron.algo.losses import (
    POLICY_LOSSES,
    LossInputs,
    LossOutput,
    aggregate,
    compute_policy_loss,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "LossInputs",
    "LossOutput",
    "aggregate",
    "compute_advantages",
    "compute_policy_loss",
    "credit_turns",
    "episode_advantages",
    "group_normalize",
    "grpo_multiturn_advantages",
    "kl_estimate",
    "kl_penalty",
    "register_advantage",
    "register_policy_loss",
    "score_trajectory",
]
