"""The user simulator as part of the run: frozen engines serving `user_sim.engines.model`, started, placed, watched
and restarted like the policy's engines, and the gyms' simulator client pointed at them.

`user_simulator(cfg, gym_names, log_dir)` yields the `gyms.user_sim.UserSimulator` the gyms call (None when no
gym of `gym_names` needs one); `userrl train` uses the same `SimulatorService`, decided before Ray starts and run
beside the policy's placement. With `user_sim.engines.model` set, it first starts `user_sim.engines.num_engines`
engines of that model, each requiring a key made for this run: in a placement group of their own (their own GPUs
on a cluster), or with `user_sim.engines.placement: policy_engines` on the policy engines' GPUs (`simulator_pool`
given the policy's placement). The client talks to the engine's OpenAI route (to sglang-router in front of several
engines), and follows a restarted engine to its new address. The engines are frozen: no weight sync; on GPUs of
their own no pause or memory release by the policy's choreography; on the GPUs of colocated policy engines they
release their KV cache and CUDA graphs while the actor trains (`trainer.handoff.MemoryHandoff`) and keep their
weights. Without a model, `user_sim.base_url` is used as it is (an external endpoint).
"""

import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyms.user_sim import UserSimulator
    from userrl_megatron.config.schema import RolloutConfig, RootConfig
    from userrl_megatron.fleet.engine import SGLangClient
    from userrl_megatron.fleet.placement import Placement
    from userrl_megatron.fleet.pool import RolloutPool

log = logging.getLogger(__name__)
KEY_ENV = "USERRL_USER_SIM_ENGINE_KEY"  # the variable the simulator engines read their key from (never exported)
PORT_OFFSET = 1000  # the simulator's engines listen from base_port + 1000: a node may hold both kinds


def simulator_rollout(cfg: "RootConfig") -> "RolloutConfig":
    """The engine settings of the simulator engines: the policy's, with the simulator's own count, TP, backend,
    SGLang memory fraction (0: the policy's) and context length (0: the simulator model's own, whatever the policy's
    engines serve); colocated (SGLang's memory saver, to release their KV cache while the actor trains) only on the
    GPUs of colocated policy engines; no weight backup, since they never release their weights; no routing replay;
    the router when there are several; a key and ports of their own; json_schema output held compact (SGLang on CPU,
    SmolLM2-135M at temperature 1 spent all 48 tokens in blank space in 2 of 24 schema requests)."""
    engines, r = cfg.user_sim.engines, cfg.rollout
    sglang_port, embedded_port = r.sglang.base_port, r.embedded.base_port
    sglang = dataclasses.replace(
        r.sglang,
        base_port=sglang_port + PORT_OFFSET if sglang_port else 0,
        mem_fraction_static=engines.mem_fraction_static or r.sglang.mem_fraction_static,
        context_length=engines.context_length,
        enable_weights_cpu_backup=False,  # frozen: they never release their weights
        enable_return_routed_experts=False,  # the policy's routing replay, not the simulator's
        constrained_json_disable_any_whitespace=True,  # json_schema output compact: no runs of blank space
    )
    embedded = dataclasses.replace(
        r.embedded,
        base_port=embedded_port + PORT_OFFSET if embedded_port else 0,
        context_length=engines.context_length,
        enable_return_routed_experts=False,
        constrained_json_disable_any_whitespace=True,  # json_schema output compact: no runs of blank space
    )
    return dataclasses.replace(
        cfg.rollout,
        sglang=sglang,
        embedded=embedded,
        backend=engines.backend or cfg.rollout.backend,
        num_engines=engines.num_engines,
        engine_tp=engines.engine_tp,
        colocate=engines.shares_policy_engines and r.colocate,
        router="sglang" if engines.num_engines > 1 else "none",
        api_key_env=KEY_ENV,
    )


def policy_engine_rollout(cfg: "RootConfig") -> "RolloutConfig":
    """The policy engines' settings as launched. With the simulator's SGLang engines on their GPUs
    (`user_sim.engines.placement: policy_engines`) SGLang's `--mem-fraction-static` is the policy's share plus the
    simulator's: SGLang sizes its KV pool as what is free after its weights less (1 - fraction) of the GPU, and the
    simulator's engines, started first, already hold their share. Each config field stays that side's own share."""
    return _counting_the_other(cfg, cfg.rollout)


def simulator_restart_rollout(cfg: "RootConfig") -> "RolloutConfig | None":
    """What a restarted simulator engine is launched with on the policy engines' GPUs (SGLang on both sides): its
    fraction plus the policy's, whose engine holds its share then (None: as at its first start)."""
    sim = simulator_rollout(cfg)
    restarted = _counting_the_other(cfg, sim)
    return None if restarted is sim else restarted


def _counting_the_other(cfg: "RootConfig", rollout: "RolloutConfig") -> "RolloutConfig":
    """`rollout` (the policy's or the simulator's engines) with SGLang's fraction raised by the other side's share,
    when both sides' SGLang engines share the policy engines' GPUs; otherwise `rollout` itself."""
    r, engines = cfg.rollout, cfg.user_sim.engines
    sim = simulator_rollout(cfg)
    if not engines.shares_policy_engines or r.backend != "sglang" or sim.backend != "sglang":
        return rollout
    fraction = round(r.sglang.mem_fraction_static + sim.sglang.mem_fraction_static, 6)
    return dataclasses.replace(rollout, sglang=dataclasses.replace(rollout.sglang, mem_fraction_static=fraction))


class SimulatorService:
    """The user simulator of a run whose gyms are `gym_names`: none (no gym needs one), the endpoint of
    `user_sim.base_url` (its client made here: a missing API key fails before anything starts), or engines the run
    serves (`user_sim.engines.model`, started by `running`). `client` is what the gyms call, `pool` the served
    engines."""

    def __init__(self, cfg: "RootConfig", gym_names: Iterable[str]) -> None:
        from gyms.base import gym_spec
        from gyms.user_sim import UserSimulator

        self.cfg = cfg
        needed = any(gym_spec(name).needs_user_sim for name in set(gym_names))
        self.served = needed and bool(cfg.user_sim.engines.model)
        self.client: UserSimulator | None = UserSimulator(cfg.user_sim) if needed and not self.served else None
        self.pool: RolloutPool | None = None

    @property
    def engines(self) -> int:
        """How many engines the run serves (0: none)."""
        return self.cfg.user_sim.engines.num_engines if self.served else 0

    @contextlib.asynccontextmanager
    async def running(self, log_dir: Path, policy: "Placement | None" = None) -> AsyncIterator["UserSimulator | None"]:
        """The client, with the served engines started first (`simulator_pool`, given the policy's placement
        `policy` when there is one); the client and then the engines closed on exit."""
        async with contextlib.AsyncExitStack() as stack:
            if self.served:
                self.pool = await stack.enter_async_context(simulator_pool(self.cfg, log_dir, policy))
                self.client = managed_client(self.cfg, self.pool)
            if self.client is not None:
                stack.push_async_callback(self.client.close)
            yield self.client


@contextlib.asynccontextmanager
async def user_simulator(
    cfg: "RootConfig", gym_names: Iterable[str], log_dir: Path
) -> AsyncIterator["UserSimulator | None"]:
    """The simulator the gyms of `gym_names` call (None: none needs one), with its engines when the run serves it
    (`user_sim.engines.model`); everything closed on exit."""
    async with SimulatorService(cfg, gym_names).running(log_dir) as sim:
        yield sim


@contextlib.asynccontextmanager
async def simulator_pool(
    cfg: "RootConfig", log_dir: Path, policy: "Placement | None" = None
) -> AsyncIterator["RolloutPool"]:
    """The simulator engines of `cfg.user_sim.engines`, started in a placement group of their own
    (`placement.reserve_placement`), or with `placement: policy_engines` on the bundles of the policy engines of
    `policy` (the policy's placement; without it, as in `userrl rollout` and `userrl eval`, on GPUs of their own)."""
    from userrl_megatron.fleet.gpu_preflight import check_gpu_run
    from userrl_megatron.fleet.placement import plan_bundles, reserve_placement, shared_placement
    from userrl_megatron.fleet.pool import RolloutPool
    from userrl_megatron.model_store import resolve_model

    rollout = simulator_rollout(cfg)
    shared = cfg.user_sim.engines.shares_policy_engines and policy is not None
    if cfg.user_sim.engines.shares_policy_engines and policy is None:
        log.warning(
            "user_sim.engines.placement = policy_engines: this command places no policy engines of its own (`userrl "
            "train` does), so the simulator's engines take GPUs of their own"
        )
    engines_only = dataclasses.replace(cfg.megatron, nnodes=1, devices_per_node=0)  # no actor ranks here
    # Ray is started here when the simulator comes first (`userrl rollout`, `userrl eval`): room for the policy's.
    bundles = rollout.num_engines * rollout.engine_tp + cfg.rollout.num_engines * cfg.rollout.engine_tp

    def check(on_gpu: bool) -> None:
        if on_gpu and policy is None:  # `userrl train` checked the whole run before placing it
            check_gpu_run(cfg, actors=False)

    with contextlib.ExitStack() as stack:
        if policy is not None and shared:  # the policy's group: reserved and removed with the policy's
            placement = shared_placement(policy, rollout.num_engines)
        else:
            placement = stack.enter_context(
                reserve_placement(
                    cfg.run, lambda on_gpu: plan_bundles(engines_only, rollout, on_gpu), cpus=bundles, check=check
                )
            )
        model_dir = str(resolve_model(cfg.user_sim.engines.model))
        dtype = cfg.user_sim.engines.dtype or cfg.model.dtype
        os.environ.pop(KEY_ENV, None)  # a key made for this run by the pool, never one left in the environment
        restart = simulator_restart_rollout(cfg) if shared else None
        async with RolloutPool(rollout, model_dir, dtype, placement, log_dir / "user_sim", restart_cfg=restart) as pool:
            log.info("user simulator: %d engine(s) of %s at %s", len(pool.urls), model_dir, _openai_url(pool))
            yield pool


def managed_client(cfg: "RootConfig", pool: "RolloutPool") -> "UserSimulator":
    """The gyms' simulator client for the engines of `pool`: their OpenAI route, their key, the served model's
    name; it follows an engine restarted at a new address, and a call that could not reach the engines waits for
    the pool to restart the dead ones (`pool.repair`, up to `rollout.engine_restart_timeout_s`) before its retry:
    however long a restart takes, it costs the call time, not its result."""
    from gyms.user_sim import UserSimulator

    settings = dataclasses.replace(cfg.user_sim, base_url=_openai_url(pool), model=pool.served_model_name)
    sim = UserSimulator(settings, api_key=pool.api_key)

    async def reconnect() -> None:
        await pool.repair(pool.cfg.engine_restart_timeout_s)  # raises once every engine is given up

    sim.reconnect = reconnect

    async def follow(index: int, client: "SGLangClient") -> None:
        if pool.router_client is None:  # behind the router the address stays the same
            await sim.retarget(_openai_url(pool))
        log.warning("user simulator engine %d restarted at %s", index, client.base_url)

    pool.add_restart_hook(follow)
    return sim


def _openai_url(pool: "RolloutPool") -> str:
    base = pool.router_client.base_url if pool.router_client is not None else pool.urls[0]
    return f"{base.rstrip('/')}/v1"
