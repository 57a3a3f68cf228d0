"""Settings of EchoGym, config section `gyms.echo`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, NON_NEGATIVE, Rule


@dataclass
class EchoGymConfig:
    """EchoGym, the toy gym of the learning test."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    turns: int = 3  # turns per episode (each asks for one letter)
    alphabet: str = "ab"  # letters the user may ask for
    same_letter: bool = True  # ask for the same letter every turn (False: a fresh letter each turn)
    seed: int = 0  # seed of the `echo-procedural` task stream
    tasks_per_split: int = 64  # tasks in each split of `echo-procedural`
    reply_delay_median_s: float = 0.0  # the user's reply delay per step: log-normal with this median (0 = none)
    reply_delay_p99_s: float = 0.0  # ... and this 99th percentile (heavy tail: a slow simulated user; >= median)

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "turns": COUNT,
        "seed": NON_NEGATIVE,
        "tasks_per_split": COUNT,
        "reply_delay_median_s": NON_NEGATIVE,
        "reply_delay_p99_s": NON_NEGATIVE,
    }
