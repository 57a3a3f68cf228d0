"""Settings of TravelGym, config section `gyms.travel`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, NON_NEGATIVE, PROBABILITY, Rule


@dataclass
class TravelGymConfig:
    """TravelGym and its scenario generator."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    search_correct_reward: float = 0.0  # reward of a correct first search of an aspect (UserRL eval: 0.2)
    preference_correct_reward: float = 0.8  # reward of a question that elicits a hidden preference (eval: 0.6)
    choice_best_reward: float = 1.0  # reward of recommending the best (cheapest correct) option
    choice_correct_reward: float = 0.8  # reward of recommending a correct but not the best option
    search_failure_interval: int = 5  # every k-th search fails on purpose (0 disables)
    elicitation_interval: int = 3  # after k off-preference utterances the user volunteers a preference
    one_choice_per_aspect: bool = True  # a second recommendation for an aspect is refused

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "search_correct_reward": PROBABILITY,
        "preference_correct_reward": PROBABILITY,
        "choice_best_reward": PROBABILITY,
        "choice_correct_reward": PROBABILITY,
        "search_failure_interval": NON_NEGATIVE,
        "elicitation_interval": COUNT,
    }
