"""Settings of the tau gyms, config section `gyms.tau`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, Rule


@dataclass
class TauGymConfig:
    """tau, tau_retail and tau_airline (tau-bench)."""

    max_steps: int = 30  # tool calls + messages to the user per episode (replaced by rollout.max_turns in training)
    data_dir: str = ""  # folder holding taubench/ and userrl/; empty = where the task was loaded from
    customer_temperature: float | None = None  # sampling temperature of the customer; None: not sent (tau-bench)
    customer_max_tokens: int | None = None  # completion limit of the customer; None: not sent (tau-bench)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
