"""A gym's typed config for one episode: `config_for(name, gyms_cfg, max_steps)`, its section of the `gyms` config
(`gyms.<section>`, typed by the settings dataclass it registered), with `max_steps` forced to the rollout's max
turns, as UserRL's env_manager does."""

import dataclasses
from typing import Any


def config_for(name: str, gyms_cfg: Any, max_steps: int) -> Any:
    """Gym `name`'s settings from the `gyms` section (their defaults when the section was made before the gym was
    registered), with `max_steps` (where they have one) forced to the rollout's max turns."""
    from gyms.base import gym_spec

    spec = gym_spec(name)
    settings: Any = getattr(gyms_cfg, spec.config_field, None)
    if not isinstance(settings, spec.config_type):
        settings = spec.config_type()
    if "max_steps" not in {f.name for f in dataclasses.fields(settings)}:
        return settings
    return dataclasses.replace(settings, max_steps=max_steps)
