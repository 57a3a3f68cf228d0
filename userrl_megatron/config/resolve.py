"""The automatic choices of a config made explicit, once, before a run starts: `resolve_config(cfg)` is the config
the run runs (and the `config.yaml` it saves), with no setting left for a component to decide on its own."""

from dataclasses import replace

from userrl_megatron.config.schema import AlgoConfig, RolloutConfig, RootConfig

ASYNC_TIS_CAP = 2.0  # algo.tis_cap = -1 (auto) in the asynchronous rollout modes


def resolve_config(cfg: RootConfig) -> RootConfig:
    """`cfg` with `algo.tis_cap: -1` and the engine flags other settings require filled in (idempotent)."""
    return replace(cfg, algo=_algo(cfg), rollout=_rollout(cfg))


def keeps_weights(rollout: RolloutConfig) -> bool:
    """Whether the engines keep a host copy of the weights they release; without one the weights come back empty
    (SGLang's memory saver maps fresh memory on resume) and only a push or disk load fills them."""
    return (rollout.sglang if rollout.backend == "sglang" else rollout.embedded).enable_weights_cpu_backup


def _algo(cfg: RootConfig) -> AlgoConfig:
    """`algo.tis_cap = -1` (auto): truncated importance sampling at `ASYNC_TIS_CAP` when the rollout runs ahead of
    the trainer (turns from older weights), off in sync mode."""
    if cfg.algo.tis_cap != -1:
        return cfg.algo
    return replace(cfg.algo, tis_cap=ASYNC_TIS_CAP if cfg.rollout.mode != "sync" else 0.0)


def _rollout(cfg: RootConfig) -> RolloutConfig:
    """Colocated engines without weight sync keep a host copy of their weights, since nothing refills the weight
    memory they release while the actor trains; routing replay needs engines that record their MoE routing."""
    rollout = cfg.rollout
    if rollout.colocate and not cfg.sync.enabled:
        rollout = replace(
            rollout,
            sglang=replace(rollout.sglang, enable_weights_cpu_backup=True),
            embedded=replace(rollout.embedded, enable_weights_cpu_backup=True),
        )
    if cfg.algo.routing_replay == "rollout":
        rollout = replace(
            rollout,
            sglang=replace(rollout.sglang, enable_return_routed_experts=True),
            embedded=replace(rollout.embedded, enable_return_routed_experts=True),
        )
    return rollout
