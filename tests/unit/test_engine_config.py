"""Checks of the engine config sections (rollout.embedded, rollout.sglang)."""

import pytest

from userrl_megatron.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.embedded.device=gpu", "rollout.embedded.device = 'gpu'; choose from auto, cpu, cuda, cuda:N"),
        ("rollout.embedded.base_port=65535", "rollout.embedded.base_port = 65535 leaves no room for"),
        ("rollout.embedded.max_running_requests=0", "rollout.embedded.max_running_requests must be >= 1, got 0"),
        ("rollout.embedded.prefix_cache_tokens=-1", "rollout.embedded.prefix_cache_tokens must be >= 0, got -1"),
        ("rollout.embedded.health_check_timeout_s=0", "rollout.embedded.health_check_timeout_s must be > 0, got 0.0"),
        ("rollout.sglang.mem_fraction_static=1.5", "rollout.sglang.mem_fraction_static must be in (0, 1], got 1.5"),
    ],
)
def test_bad_engine_settings_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_defaults_serve_on_loopback() -> None:
    cfg = load_config(overrides=["rollout.embedded.device=cuda:1"])
    assert cfg.rollout.embedded.host == "127.0.0.1" and cfg.rollout.sglang.host == "127.0.0.1"
    assert cfg.rollout.embedded.device == "cuda:1"
