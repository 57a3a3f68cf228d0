"""Value ranges of numeric options, over every section: one table, one message format."""

import operator
from collections.abc import Callable

from userrl_megatron.config.schema import RootConfig

Rule = tuple[str, Callable[[float], bool]]

COUNT: Rule = (">= 1", lambda v: v >= 1)
NON_NEGATIVE: Rule = (">= 0", lambda v: v >= 0)
POSITIVE: Rule = ("> 0", lambda v: v > 0)
PROBABILITY: Rule = ("in [0, 1]", lambda v: 0 <= v <= 1)
OPEN_PROBABILITY: Rule = ("in (0, 1]", lambda v: 0 < v <= 1)
BETA: Rule = ("in [0, 1)", lambda v: 0 <= v < 1)
TOP_K: Rule = ("-1 (disabled) or >= 1", lambda v: v == -1 or v >= 1)
AUTO_OR_NON_NEGATIVE: Rule = ("-1 (auto) or >= 0", lambda v: v == -1 or v >= 0)

GYMS_WITH_STEP_LIMITS = ("function", "intention", "persuade", "search", "tau", "telepathy", "travel", "turtle", "echo")
# Numeric options checked elsewhere (parallel sizes and ports: checks.py and layout.py; generator.terms: 1..4)
# or free (dual_clip_c <= 1 disables dual clipping; moe_aux_loss_coef < 0 means the HF config's).
CHECKED_ELSEWHERE = (
    "megatron.tensor_model_parallel_size",
    "megatron.pipeline_model_parallel_size",
    "megatron.virtual_pipeline_model_parallel_size",
    "megatron.context_parallel_size",
    "megatron.expert_model_parallel_size",
    "megatron.nnodes",
    "megatron.devices_per_node",
    "rollout.num_engines",
    "rollout.engine_tp",
    "rollout.sglang.base_port",
    "rollout.embedded.base_port",
    "gyms.function.generator.terms",
    "algo.dual_clip_c",
    "megatron.moe_aux_loss_coef",
)

RANGES: dict[str, Rule] = {
    "run.total_steps": COUNT,
    "plan.device_memory_gb": POSITIVE,
    "plan.host_memory_gb": POSITIVE,
    "megatron.recompute_num_layers": NON_NEGATIVE,
    "plan.context_gb": NON_NEGATIVE,
    "plan.engine_runtime_gb": NON_NEGATIVE,
    "run.seed": NON_NEGATIVE,
    "model.max_context_length": COUNT,
    "megatron.micro_batch_tokens": COUNT,
    "megatron.lr": POSITIVE,
    "megatron.min_lr": NON_NEGATIVE,
    "megatron.lr_warmup_steps": NON_NEGATIVE,
    "megatron.lr_decay_steps": NON_NEGATIVE,
    "megatron.weight_decay": NON_NEGATIVE,
    "megatron.adam_beta1": BETA,
    "megatron.adam_beta2": BETA,
    "megatron.adam_eps": POSITIVE,
    "megatron.grad_clip": NON_NEGATIVE,
    "user_sim.engines.num_engines": COUNT,
    "user_sim.engines.engine_tp": COUNT,
    "user_sim.engines.mem_fraction_static": PROBABILITY,
    "user_sim.engines.context_length": NON_NEGATIVE,
    "rollout.prompts_per_step": COUNT,
    "rollout.n_samples_per_prompt": COUNT,
    "rollout.max_turns": COUNT,
    "rollout.max_prompt_tokens": COUNT,
    "rollout.max_response_tokens": COUNT,
    "rollout.max_new_tokens_per_turn": COUNT,
    "rollout.temperature": NON_NEGATIVE,
    "rollout.top_p": OPEN_PROBABILITY,
    "rollout.top_k": TOP_K,
    "rollout.max_concurrent_episodes": COUNT,
    "rollout.max_staleness": COUNT,
    "rollout.over_sample_groups": NON_NEGATIVE,
    "rollout.request_timeout_s": POSITIVE,
    "rollout.health_check_interval_s": NON_NEGATIVE,
    "rollout.engine_stall_timeout_s": POSITIVE,
    "rollout.max_infra_failure_rate": PROBABILITY,
    "rollout.max_infra_failed_steps": COUNT,
    "rollout.engine_restart_timeout_s": POSITIVE,
    "rollout.engine_max_restarts": NON_NEGATIVE,
    "rollout.generate_failovers": NON_NEGATIVE,
    "rollout.embedded.max_running_requests": COUNT,
    "rollout.embedded.max_prefill_tokens": COUNT,
    "rollout.embedded.prefix_cache_tokens": NON_NEGATIVE,
    "rollout.embedded.threads": NON_NEGATIVE,
    "rollout.embedded.context_length": NON_NEGATIVE,
    "rollout.embedded.random_seed": NON_NEGATIVE,
    "rollout.embedded.health_check_timeout_s": POSITIVE,
    "rollout.embedded.startup_timeout_s": POSITIVE,
    "rollout.embedded.control_timeout_s": POSITIVE,
    "rollout.embedded.max_request_bytes": COUNT,
    "rollout.embedded.max_prompt_chars": COUNT,
    "rollout.embedded.max_generate_request_bytes": COUNT,
    "rollout.embedded.max_top_logprobs_num": NON_NEGATIVE,
    "rollout.embedded.idle_timeout_s": POSITIVE,
    "rollout.embedded.body_timeout_s": POSITIVE,
    "rollout.embedded.max_connections": COUNT,
    "rollout.embedded.max_weight_payload_bytes": NON_NEGATIVE,
    "rollout.sglang.mem_fraction_static": OPEN_PROBABILITY,
    "rollout.sglang.startup_timeout_s": POSITIVE,
    "rollout.sglang.max_total_tokens": NON_NEGATIVE,
    "rollout.sglang.context_length": NON_NEGATIVE,
    **{f"gyms.{gym}.max_steps": COUNT for gym in GYMS_WITH_STEP_LIMITS},
    "gyms.function.generator.seed": NON_NEGATIVE,
    "gyms.echo.seed": NON_NEGATIVE,
    "gyms.function.generator.tasks_per_split": COUNT,
    "gyms.function.generator.max_input": COUNT,
    "gyms.intention.multi_detail_penalty": PROBABILITY,
    "gyms.intention.history_turns": NON_NEGATIVE,
    "gyms.search.max_search_steps": COUNT,
    "gyms.search.max_search_results": COUNT,
    "gyms.search.judge_max_tokens": COUNT,
    "gyms.search.web_timeout_s": POSITIVE,
    "gyms.search.web_retries": NON_NEGATIVE,
    "gyms.travel.search_correct_reward": PROBABILITY,
    "gyms.travel.preference_correct_reward": PROBABILITY,
    "gyms.travel.choice_best_reward": PROBABILITY,
    "gyms.travel.choice_correct_reward": PROBABILITY,
    "gyms.travel.search_failure_interval": NON_NEGATIVE,
    "gyms.travel.elicitation_interval": COUNT,
    "gyms.turtle.success_threshold": PROBABILITY,
    "gyms.echo.turns": COUNT,
    "gyms.echo.tasks_per_split": COUNT,
    "gyms.echo.reply_delay_median_s": NON_NEGATIVE,
    "gyms.echo.reply_delay_p99_s": NON_NEGATIVE,
    "user_sim.temperature": NON_NEGATIVE,
    "user_sim.max_tokens": COUNT,
    "user_sim.timeout_s": POSITIVE,
    "user_sim.max_retries": NON_NEGATIVE,
    "user_sim.backoff_s": NON_NEGATIVE,
    "user_sim.backoff_max_s": NON_NEGATIVE,
    "user_sim.max_concurrency": COUNT,
    "user_sim.max_reply_chars": COUNT,
    "algo.gamma": PROBABILITY,
    "algo.eps": POSITIVE,
    "algo.clip_low": POSITIVE,
    "algo.clip_high": POSITIVE,
    "algo.kl_coef": NON_NEGATIVE,
    "algo.entropy_coef": NON_NEGATIVE,
    "algo.tis_cap": AUTO_OR_NON_NEGATIVE,
    "algo.ppo_epochs": COUNT,
    "algo.mini_batches_per_step": COUNT,
    "sync.bucket_mb": COUNT,
    "checkpoint.every_steps": NON_NEGATIVE,
    "checkpoint.keep_last": COUNT,
    "logging.rollout_dump_every": NON_NEGATIVE,
    "logging.rollout_dump_count": NON_NEGATIVE,
    "eval.every_steps": NON_NEGATIVE,
    "eval.max_tasks": NON_NEGATIVE,
    "eval.n_samples_per_prompt": COUNT,
    "eval.temperature": NON_NEGATIVE,
    "eval.max_turns": NON_NEGATIVE,
    "eval.max_concurrent_episodes": NON_NEGATIVE,
    "eval.retries": NON_NEGATIVE,
    "sft.expert_tasks": NON_NEGATIVE,
    "sft.val_max_rows": NON_NEGATIVE,
    "sft.epochs": COUNT,
    "sft.batch_tokens": COUNT,
    "sft.max_tokens": NON_NEGATIVE,
    "sft.lr": POSITIVE,
    "sft.min_lr": NON_NEGATIVE,
    "sft.warmup_ratio": PROBABILITY,
    "sft.grad_clip": NON_NEGATIVE,
    "sft.val_every_steps": NON_NEGATIVE,
    "sft.save_every_steps": NON_NEGATIVE,
}


def range_problems(cfg: RootConfig) -> list[str]:
    """`key must be <range>, got <value>` for every option of RANGES outside its range."""
    problems = []
    for dotted, (text, ok) in RANGES.items():
        value: float = operator.attrgetter(dotted)(cfg)  # a numeric option
        if not ok(value):
            problems.append(f"{dotted} must be {text}, got {value}")
    return problems
