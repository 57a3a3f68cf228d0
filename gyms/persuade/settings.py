"""Settings of PersuadeGym, config section `gyms.persuade`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, Rule


@dataclass
class PersuadeGymConfig:
    """PersuadeGym."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    reward_baseline: str = "best"  # stance moves are paid from "best" stance so far (fix) or "previous" (UserRL)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"reward_baseline": ("best", "previous")}
