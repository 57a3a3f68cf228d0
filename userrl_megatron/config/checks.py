"""Cross-field checks that must fail before any work starts (all problems are reported at once)."""

import functools
import re

from gyms.config import FUNCTION_OPERATORS
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.schema import RootConfig

# Allowed values of string-valued options, keyed by dotted path.
CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.tool_format": ("hermes", "tags"),
    "megatron.transformer_impl": ("auto", "transformer_engine", "local"),
    "megatron.recompute": ("none", "selective", "full"),
    "megatron.lr_schedule": ("constant", "linear", "cosine"),
    "rollout.backend": ("embedded", "sglang"),
    "rollout.sglang.device": ("auto", "cpu", "cuda"),
    "rollout.router": ("none", "sglang"),
    "rollout.router_policy": ("round_robin", "random", "cache_aware", "power_of_two"),
    "algo.adv_estimator": ("grpo", "grpo_multiturn"),
    "algo.turn_level": ("Equalized", "R2G", "EM"),
    "algo.trajectory_score": ("Sum", "R2G"),
    "algo.policy_loss": ("ppo_clip",),
    "algo.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.user_sim_failure": ("drop", "mask", "keep"),
    "gyms.persuade.reward_baseline": ("best", "previous"),
    "gyms.search.judge": ("llm", "exact"),
    "gyms.search.backend": ("offline", "web"),
    "user_sim.http_backend": ("aiohttp", "httpx"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}
LOGGING_BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
GROUP_ESTIMATORS = ("grpo", "grpo_multiturn")


def check_config(cfg: RootConfig) -> None:
    """Raise ConfigError listing every inconsistency in `cfg`."""
    problems = _choice_problems(cfg) + _parallel_problems(cfg) + _budget_problems(cfg) + _algo_problems(cfg)
    problems += _gym_problems(cfg) + _pool_problems(cfg) + _engine_problems(cfg)
    bad_backends = [b for b in cfg.logging.backends if b not in LOGGING_BACKENDS]
    if bad_backends:
        problems.append(f"logging.backends: unknown {bad_backends}; choose from {', '.join(LOGGING_BACKENDS)}")
    if cfg.checkpoint.keep_last < 1:
        problems.append(f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    if cfg.sync.bucket_mb <= 0:
        problems.append(f"sync.bucket_mb must be > 0, got {cfg.sync.bucket_mb}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _choice_problems(cfg: RootConfig) -> list[str]:
    problems = []
    for dotted, allowed in CHOICES.items():
        value = functools.reduce(getattr, dotted.split("."), cfg)
        if value not in allowed:
            problems.append(f"{dotted} = {value!r}; choose from {', '.join(allowed)}")
    return problems


def _parallel_problems(cfg: RootConfig) -> list[str]:
    m = cfg.megatron
    sizes = {
        "megatron.tensor_model_parallel_size": m.tensor_model_parallel_size,
        "megatron.pipeline_model_parallel_size": m.pipeline_model_parallel_size,
        "megatron.virtual_pipeline_model_parallel_size": m.virtual_pipeline_model_parallel_size,
        "megatron.context_parallel_size": m.context_parallel_size,
        "megatron.expert_model_parallel_size": m.expert_model_parallel_size,
        "megatron.nnodes": m.nnodes,
        "megatron.devices_per_node": m.devices_per_node,
        "rollout.num_engines": cfg.rollout.num_engines,
        "rollout.engine_tp": cfg.rollout.engine_tp,
    }
    problems = [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if problems:
        return problems
    world = m.nnodes * m.devices_per_node
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world % model_parallel:
        problems.append(
            "megatron: tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
            f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} x {m.context_parallel_size} = "
            f"{model_parallel} does not divide the actor device count megatron.nnodes x megatron.devices_per_node "
            f"= {world}, so no data-parallel size makes tp*pp*cp*dp equal it"
        )
    else:
        data_parallel = world // model_parallel
        if data_parallel % m.expert_model_parallel_size:
            problems.append(
                f"megatron.expert_model_parallel_size = {m.expert_model_parallel_size} must divide the "
                f"data-parallel size {data_parallel}"
            )
    if m.virtual_pipeline_model_parallel_size > 1 and m.pipeline_model_parallel_size < 2:
        problems.append("megatron.virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size >= 2")
    if m.sequence_parallel and m.tensor_model_parallel_size < 2:
        problems.append("megatron.sequence_parallel needs tensor_model_parallel_size >= 2")
    if m.micro_batch_tokens < 1:
        problems.append(f"megatron.micro_batch_tokens must be >= 1, got {m.micro_batch_tokens}")
    if m.lr_schedule != "constant" and m.lr_decay_steps <= m.lr_warmup_steps:
        problems.append(
            f"megatron.lr_schedule = {m.lr_schedule} needs megatron.lr_decay_steps > megatron.lr_warmup_steps, "
            f"got {m.lr_decay_steps} <= {m.lr_warmup_steps}"
        )
    if m.min_lr > m.lr:
        problems.append(f"megatron.min_lr = {m.min_lr} exceeds megatron.lr = {m.lr}")
    return problems


def _budget_problems(cfg: RootConfig) -> list[str]:
    r, problems = cfg.rollout, []
    context = cfg.model.max_context_length
    if r.max_prompt_tokens + r.max_response_tokens > context:
        problems.append(
            f"rollout.max_prompt_tokens + rollout.max_response_tokens = {r.max_prompt_tokens} + "
            f"{r.max_response_tokens} exceeds model.max_context_length = {context}"
        )
    if r.max_new_tokens_per_turn > r.max_response_tokens:
        problems.append(
            f"rollout.max_new_tokens_per_turn = {r.max_new_tokens_per_turn} exceeds "
            f"rollout.max_response_tokens = {r.max_response_tokens}"
        )
    if cfg.megatron.micro_batch_tokens < r.max_prompt_tokens + r.max_response_tokens:
        problems.append(
            f"megatron.micro_batch_tokens = {cfg.megatron.micro_batch_tokens} cannot hold one episode of "
            f"rollout.max_prompt_tokens + rollout.max_response_tokens = {r.max_prompt_tokens + r.max_response_tokens}"
        )
    for key in ("max_turns", "max_new_tokens_per_turn", "prompts_per_step", "n_samples_per_prompt"):
        if getattr(r, key) < 1:
            problems.append(f"rollout.{key} must be >= 1, got {getattr(r, key)}")
    return problems


def _algo_problems(cfg: RootConfig) -> list[str]:
    a, r, problems = cfg.algo, cfg.rollout, []
    if a.adv_estimator in GROUP_ESTIMATORS and r.n_samples_per_prompt < 2:
        problems.append(
            f"algo.adv_estimator = {a.adv_estimator} normalises within a group: rollout.n_samples_per_prompt "
            f"must be > 1, got {r.n_samples_per_prompt}"
        )
    if not 0.0 <= a.gamma <= 1.0:
        problems.append(f"algo.gamma must be in [0, 1], got {a.gamma}")
    if a.clip_low <= 0 or a.clip_high <= 0:
        problems.append(f"algo.clip_low and algo.clip_high must be > 0, got {a.clip_low}, {a.clip_high}")
    if a.mini_batches_per_step < 1 or a.ppo_epochs < 1:
        problems.append("algo.mini_batches_per_step and algo.ppo_epochs must be >= 1")
    else:
        episodes = r.prompts_per_step * r.n_samples_per_prompt
        if episodes % a.mini_batches_per_step:
            problems.append(
                f"algo.mini_batches_per_step = {a.mini_batches_per_step} must divide the episodes per step "
                f"rollout.prompts_per_step x rollout.n_samples_per_prompt = {episodes}"
            )
    if a.kl_coef < 0 or a.entropy_coef < 0 or a.tis_cap < 0:
        problems.append("algo.kl_coef, algo.entropy_coef and algo.tis_cap must be >= 0")
    return problems


def _gym_problems(cfg: RootConfig) -> list[str]:
    gen, sim, problems = cfg.gyms.function.generator, cfg.user_sim, []
    if not 1 <= gen.terms <= 4:
        problems.append(f"gyms.function.generator.terms must be in 1..4 (inputs a, b, c, d), got {gen.terms}")
    unknown = [op for op in gen.operators if op not in FUNCTION_OPERATORS]
    if unknown:
        allowed = " ".join(FUNCTION_OPERATORS)
        problems.append(f"gyms.function.generator.operators: unknown {unknown}; choose from {allowed}")
    if gen.terms > 1 and not [op for op in gen.operators if op != "**"]:
        problems.append("gyms.function.generator.operators needs one of + - * / when terms > 1")
    if gen.prompt_style not in ("userrl", "compact"):
        problems.append(f"gyms.function.generator.prompt_style = {gen.prompt_style!r}; choose from userrl, compact")
    if gen.max_input < 1 or gen.tasks_per_split < 1:
        problems.append("gyms.function.generator.max_input and tasks_per_split must be >= 1")
    travel = cfg.gyms.travel
    if travel.search_failure_interval < 0 or travel.elicitation_interval < 1:
        problems.append("gyms.travel.search_failure_interval must be >= 0 and elicitation_interval >= 1")
    if sim.max_concurrency < 1 or sim.timeout_s <= 0 or sim.max_retries < 0 or sim.backoff_s < 0:
        problems.append("user_sim: max_concurrency >= 1, timeout_s > 0, max_retries >= 0 and backoff_s >= 0 required")
    return problems


def _pool_problems(cfg: RootConfig) -> list[str]:
    r = cfg.rollout
    problems = [
        f"rollout.{key} must be >= 0, got {getattr(r, key)}"
        for key in ("health_check_interval_s", "engine_max_restarts", "generate_failovers")
        if getattr(r, key) < 0
    ]
    if r.max_concurrent_episodes < 1:
        problems.append(f"rollout.max_concurrent_episodes must be >= 1, got {r.max_concurrent_episodes}")
    return problems


def _engine_problems(cfg: RootConfig) -> list[str]:
    e, g, problems = cfg.rollout.embedded, cfg.rollout.sglang, []
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", e.device):
        problems.append(f"rollout.embedded.device = {e.device!r}; choose from auto, cpu, cuda, cuda:N")
    for key, port in (("rollout.embedded.base_port", e.base_port), ("rollout.sglang.base_port", g.base_port)):
        if port and not 1 <= port <= 65535 - cfg.rollout.num_engines:  # 0: the pool picks free ports
            problems.append(f"{key} = {port} leaves no room for rollout.num_engines = {cfg.rollout.num_engines} ports")
    for key in ("max_running_requests", "max_prefill_tokens"):
        if getattr(e, key) < 1:
            problems.append(f"rollout.embedded.{key} must be >= 1, got {getattr(e, key)}")
    if e.prefix_cache_tokens < 0 or e.context_length < 0:
        problems.append("rollout.embedded.prefix_cache_tokens and rollout.embedded.context_length must be >= 0")
    timeouts = {
        "rollout.embedded.health_check_timeout_s": e.health_check_timeout_s,
        "rollout.embedded.startup_timeout_s": e.startup_timeout_s,
        "rollout.sglang.startup_timeout_s": g.startup_timeout_s,
    }
    problems += [f"{key} must be > 0, got {value}" for key, value in timeouts.items() if value <= 0]
    if not 0.0 < g.mem_fraction_static <= 1.0:
        problems.append(f"rollout.sglang.mem_fraction_static must be in (0, 1], got {g.mem_fraction_static}")
    return problems
