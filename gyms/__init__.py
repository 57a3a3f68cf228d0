"""Gyms: the UserRL environments and tau-bench retail/airline behind one async protocol.

`make_gym(name, task, config, user_sim)` builds one gym per episode; `list_gyms()` names them;
`config_for(name, gyms_cfg, max_steps)` gives a gym's typed config with the rollout's turn limit.
"""

from gyms.base import Gym, GymSpec, StepResult, gym_spec, list_gyms, make_gym, parse_action, register_gym
from gyms.config import config_for
from gyms.data import DataMissingError, data_dir

__all__ = [
    "DataMissingError",
    "Gym",
    "GymSpec",
    "StepResult",
    "config_for",
    "data_dir",
    "gym_spec",
    "list_gyms",
    "make_gym",
    "parse_action",
    "register_gym",
]
