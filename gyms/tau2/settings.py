"""Settings of the tau2 gyms, config section `gyms.tau2`. `max_steps` is replaced by the rollout's max turns."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, Rule


@dataclass
class Tau2GymConfig:
    """tau2_mock (solo mode), tau2_mock_chat, tau2_airline and tau2_retail (tau2-bench)."""

    max_steps: int = 30  # agent actions per episode (replaced by rollout.max_turns in training)
    data_dir: str = ""  # folder holding tau2/; empty = the default data folder
    user_temperature: float | None = None  # sampling temperature of the simulated user; None: user_sim.temperature
    user_max_tokens: int | None = None  # completion limit of one simulated-user call; None: user_sim.max_tokens
    max_user_tool_calls: int = 10  # the simulated user's tool calls in one turn; then it is asked for its message
    max_errors: int = 10  # tool results with an error (both parties) that end the episode as too_many_errors
    nl_judge: bool = False  # grade NL_ASSERTION with the simulator client as judge; off: reported as unscored
    nl_judge_max_tokens: int | None = None  # completion limit of one judge call; None: user_sim.max_tokens

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT, "max_user_tool_calls": COUNT, "max_errors": COUNT}
