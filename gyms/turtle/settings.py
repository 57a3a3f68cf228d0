"""Settings of TurtleGym, config section `gyms.turtle`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, PROBABILITY, Rule


@dataclass
class TurtleGymConfig:
    """TurtleGym."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    success_threshold: float = 1.0  # rubric score that solves the story and ends the episode (UserRL default 0.9)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT, "success_threshold": PROBABILITY}
