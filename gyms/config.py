"""A gym's typed config for one episode: `config_for(name, gyms_cfg, max_steps)`, from the built-in gyms' typed
sections (`userrl_megatron/config/gyms.py`) or a plug-in gym's `gyms.plugins` entry, with `max_steps` forced to
the rollout's max turns, as UserRL's env_manager does."""

import dataclasses
from typing import Any

from userrl_megatron.config.gyms import settings_problems


def config_for(name: str, gyms_cfg: Any, max_steps: int) -> Any:
    """Gym `name`'s typed config from the `gyms` section, with `max_steps` forced to the rollout's max turns."""
    from gyms.base import gym_spec

    spec = gym_spec(name)
    if spec.config_type is None:
        return dataclasses.replace(getattr(gyms_cfg, spec.config_field), max_steps=max_steps)
    return plugin_config(
        spec.config_type, f"gyms.plugins.{spec.config_field}", gyms_cfg.plugins.get(spec.config_field, {}), max_steps
    )


def plugin_config(config_type: type, where: str, values: dict[str, Any], max_steps: int) -> Any:
    """A plug-in gym's typed config from its `gyms.plugins` entry; ValueError naming a setting it does not have, or
    what its own `problems(where)` finds wrong with the settings together."""
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    config = config_type(**values)
    problems = settings_problems(config, where)
    if problems:
        raise ValueError("; ".join(problems))
    return dataclasses.replace(config, max_steps=max_steps) if "max_steps" in fields else config
