"""Settings of the tau2 gyms, config section `gyms.tau2`. `max_steps` is replaced by the rollout's max turns."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, Rule


@dataclass
class Tau2GymConfig:
    """tau2_mock (tau2-bench, solo mode)."""

    max_steps: int = 30  # tool calls per episode (replaced by rollout.max_turns in training)
    data_dir: str = ""  # folder holding tau2/; empty = the default data folder

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
