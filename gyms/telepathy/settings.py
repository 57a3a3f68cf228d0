"""Settings of TelepathyGym, config section `gyms.telepathy`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, Rule


@dataclass
class TelepathyGymConfig:
    """TelepathyGym."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
