"""Settings of IntentionGym, config section `gyms.intention`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, NON_NEGATIVE, PROBABILITY, Rule


@dataclass
class IntentionGymConfig:
    """IntentionGym."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    multi_detail_penalty: float = 0.2  # reward cut per extra detail covered by one question
    history_turns: int = 3  # past exchanges shown to the user simulator and the coverage judge

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "multi_detail_penalty": PROBABILITY,
        "history_turns": NON_NEGATIVE,
    }
