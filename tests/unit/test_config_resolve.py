"""What `config.resolve` fills in before a run starts, and the router's command line."""

import pytest

from userrl_megatron.config import load_config
from userrl_megatron.config.resolve import resolve_config
from userrl_megatron.config.schema import SGLangConfig
from userrl_megatron.fleet.router import router_command
from userrl_megatron.fleet.sglang import KEY_ENTRY


@pytest.mark.parametrize(
    "colocate, sync, backup",
    [("true", "false", True), ("true", "true", False), ("false", "false", False)],
)
def test_weights_backup_only_when_colocated_without_sync(colocate: str, sync: str, backup: bool) -> None:
    # Nothing refills the weight memory a colocated engine releases unless a sync pushes weights into it.
    cfg = load_config(overrides=[f"rollout.colocate={colocate}", f"sync.enabled={sync}"], check=False)
    assert resolve_config(cfg).rollout.sglang.enable_weights_cpu_backup is backup
    assert cfg.rollout.sglang.enable_weights_cpu_backup is False  # the run's own config is left as it was


@pytest.mark.parametrize(
    "mode, tis_cap, actor_cap",
    [("sync", "-1", 0.0), ("one_step_off", "-1", 2.0), ("one_step_off", "0", 0.0), ("sync", "3.0", 3.0)],
)
def test_truncated_importance_sampling_is_on_by_default_only_in_asynchronous_modes(
    mode: str, tis_cap: str, actor_cap: float
) -> None:
    cfg = load_config(overrides=[f"rollout.mode={mode}", f"algo.tis_cap={tis_cap}"])
    assert resolve_config(cfg).algo.tis_cap == actor_cap
    assert resolve_config(resolve_config(cfg)) == resolve_config(cfg)  # resolving twice changes nothing
    assert cfg.algo.tis_cap == float(tis_cap)  # the run's own config is left as it was


def test_routing_replay_turns_on_the_engines_routing_capture() -> None:
    cfg = load_config(overrides=["algo.routing_replay=rollout"], check=False)
    rollout = resolve_config(cfg).rollout
    assert rollout.sglang.enable_return_routed_experts and rollout.embedded.enable_return_routed_experts
    plain = resolve_config(load_config(check=False)).rollout
    assert not plain.sglang.enable_return_routed_experts and not plain.embedded.enable_return_routed_experts


def test_router_command() -> None:
    command = router_command(SGLangConfig(python="py"), ["http://a:1", "http://b:2"], 30100, 29100, "cache_aware")
    assert command == [
        "py", "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1",
        "--port", "30100",
        "--worker-urls", "http://a:1", "http://b:2",
        "--policy", "cache_aware",
        "--prometheus-port", "29100",
        "--prometheus-host", "127.0.0.1",
        "--log-level", "warn",
    ]  # fmt: skip
    keyed = router_command(SGLangConfig(python="py"), ["http://a:1"], 30100, 29100, api_key_env="KEY_VAR")
    assert keyed[:4] == ["py", str(KEY_ENTRY), "KEY_VAR", "sglang_router.launch_router"]  # --api-key from $KEY_VAR
    assert keyed[4:] == router_command(SGLangConfig(python="py"), ["http://a:1"], 30100, 29100)[3:]
    with pytest.raises(ValueError, match=r"^router policy must be one of round_robin, random, cache_aware, "):
        router_command(SGLangConfig(), ["http://a:1"], 1, 2, "manual")
    with pytest.raises(ValueError, match=r"^the router needs at least one worker$"):
        router_command(SGLangConfig(), [], 1, 2)
