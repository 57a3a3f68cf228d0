"""Typed configuration: schema dataclasses, the loader (defaults -> YAML files -> overrides) and checks."""

from userrl_megatron.config.loader import ConfigError, load_config, save_config, to_yaml
from userrl_megatron.config.schema import (
    AlgoConfig,
    CheckpointConfig,
    EvalConfig,
    GymsConfig,
    LoggingConfig,
    MegatronConfig,
    ModelConfig,
    RolloutConfig,
    RootConfig,
    RunConfig,
    SFTConfig,
    SGLangConfig,
    SyncConfig,
    UserSimConfig,
)

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "EvalConfig",
    "GymsConfig",
    "LoggingConfig",
    "MegatronConfig",
    "ModelConfig",
    "RolloutConfig",
    "RootConfig",
    "RunConfig",
    "SFTConfig",
    "SGLangConfig",
    "SyncConfig",
    "UserSimConfig",
    "load_config",
    "save_config",
    "to_yaml",
]
