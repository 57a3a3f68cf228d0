"""Cross-field checks that must fail before any work starts (all problems are reported at once)."""

import functools
import re

from userrl_megatron.config.env_names import NO_KEY, env_field_problems
from userrl_megatron.config.gyms import settings_problems
from userrl_megatron.config.layout import layout_problems
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.model_fit import model_fit_problems
from userrl_megatron.config.ranges import range_problems
from userrl_megatron.config.rules import choice_problem
from userrl_megatron.config.schema import RootConfig

# Allowed values of the string-valued options of the core sections, keyed by dotted path (a gym's settings carry
# their own: `CHOICES` of its settings dataclass).
CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.tool_format": ("auto", "hermes", "tags"),
    "megatron.transformer_impl": ("auto", "transformer_engine", "local"),
    "megatron.recompute": ("none", "selective", "full"),
    "megatron.lr_schedule": ("constant", "linear", "cosine"),
    "checkpoint.optimizer_format": ("dp_reshardable", "fully_reshardable"),
    "sft.lr_schedule": ("constant", "linear", "cosine"),
    "rollout.backend": ("embedded", "sglang"),
    "rollout.sglang.device": ("auto", "cpu", "cuda"),
    "rollout.embedded.cpu_linear": ("onednn", "torch"),
    "rollout.router": ("none", "sglang"),
    "rollout.reply_without_tool_call": ("", "end", "action"),
    "rollout.mode": ("sync", "one_step_off"),
    "sync.method": ("auto", "distributed", "tensor"),
    "rollout.router_policy": ("round_robin", "random", "cache_aware", "power_of_two"),
    "algo.adv_estimator": ("grpo", "grpo_multiturn"),
    "algo.turn_level": ("Equalized", "R2G", "EM"),
    "algo.trajectory_score": ("Sum", "R2G"),
    "algo.policy_loss": ("ppo_clip",),
    "algo.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.user_sim_failure": ("drop", "mask", "keep"),
    "algo.routing_replay": ("none", "rollout"),
    "user_sim.http_backend": ("aiohttp", "httpx"),
    "user_sim.structured": ("auto", "on", "off"),
    "user_sim.engines.backend": ("", "embedded", "sglang"),
    "user_sim.engines.placement": ("own", "policy_engines"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}
LOGGING_BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
GROUP_ESTIMATORS = ("grpo", "grpo_multiturn")


def check_config(cfg: RootConfig, on_gpu: bool | None = None) -> None:
    """Raise ConfigError listing every inconsistency in `cfg`.

    `on_gpu`: whether the actor ranks will get CUDA devices (None: not known here; `run.device = cpu` says no)."""
    if on_gpu is None and cfg.run.device == "cpu":
        on_gpu = False
    problems = range_problems(cfg) + env_field_problems(cfg) + _choice_problems(cfg)
    problems += _parallel_problems(cfg, on_gpu) + model_fit_problems(cfg) + _budget_problems(cfg)
    problems += _algo_problems(cfg) + _gym_problems(cfg) + _engine_problems(cfg) + _sync_problems(cfg, on_gpu)
    problems += _mode_problems(cfg) + _sglang_gpu_problems(cfg, on_gpu) + _shared_simulator_problems(cfg)
    bad_backends = [b for b in cfg.logging.backends if b not in LOGGING_BACKENDS]
    if bad_backends:
        problems.append(f"logging.backends: unknown {bad_backends}; choose from {', '.join(LOGGING_BACKENDS)}")
    if problems:
        raise ConfigError(problems)


def _choice_problems(cfg: RootConfig) -> list[str]:
    found = (
        choice_problem(dotted, functools.reduce(getattr, dotted.split("."), cfg), allowed)
        for dotted, allowed in CHOICES.items()
    )
    return [problem for problem in found if problem]


def _parallel_problems(cfg: RootConfig, on_gpu: bool | None) -> list[str]:
    m = cfg.megatron
    sizes = {
        "megatron.nnodes": m.nnodes,
        "megatron.devices_per_node": m.devices_per_node,
        "rollout.num_engines": cfg.rollout.num_engines,
        "rollout.engine_tp": cfg.rollout.engine_tp,
    }
    problems = [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if problems:
        return problems
    problems = layout_problems(m, m.nnodes * m.devices_per_node, on_gpu)
    if m.context_parallel_size > 1 and cfg.algo.loss_agg == "seq-mean-token-mean":
        problems.append("algo.loss_agg = seq-mean-token-mean is not supported with megatron.context_parallel_size > 1")
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
    if 1 <= cfg.megatron.micro_batch_tokens < r.max_prompt_tokens + r.max_response_tokens:
        problems.append(
            f"megatron.micro_batch_tokens = {cfg.megatron.micro_batch_tokens} cannot hold one episode of "
            f"rollout.max_prompt_tokens + rollout.max_response_tokens = {r.max_prompt_tokens + r.max_response_tokens}"
        )
    return problems


def _algo_problems(cfg: RootConfig) -> list[str]:
    a, r, problems = cfg.algo, cfg.rollout, []
    if a.adv_estimator in GROUP_ESTIMATORS and r.n_samples_per_prompt < 2:
        problems.append(
            f"algo.adv_estimator = {a.adv_estimator} normalises within a group: rollout.n_samples_per_prompt "
            f"must be > 1, got {r.n_samples_per_prompt}"
        )
    if a.mini_batches_per_step >= 1:
        episodes = r.prompts_per_step * r.n_samples_per_prompt
        if episodes % a.mini_batches_per_step:
            problems.append(
                f"algo.mini_batches_per_step = {a.mini_batches_per_step} must divide the episodes per step "
                f"rollout.prompts_per_step x rollout.n_samples_per_prompt = {episodes}"
            )
    return problems


def _gym_problems(cfg: RootConfig) -> list[str]:
    """Each gym's settings, checked by their own ranges, choices and `problems` (`config.gyms.settings_problems`)."""
    return settings_problems(cfg.gyms, "gyms")


def _engine_problems(cfg: RootConfig) -> list[str]:
    e, g, problems = cfg.rollout.embedded, cfg.rollout.sglang, []
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", e.device):
        problems.append(f"rollout.embedded.device = {e.device!r}; choose from auto, cpu, cuda, cuda:N")
    for key, port in (("rollout.embedded.base_port", e.base_port), ("rollout.sglang.base_port", g.base_port)):
        if port and not 1 <= port <= 65535 - cfg.rollout.num_engines:  # 0: the pool picks free ports
            problems.append(f"{key} = {port} leaves no room for rollout.num_engines = {cfg.rollout.num_engines} ports")
    if cfg.rollout.api_key_env == NO_KEY:
        problems.append(
            "rollout.api_key_env = none: every engine a run starts requires a key; name the variable that holds it "
            "(left unset, the run makes a random key)"
        )
    return problems


def _sync_problems(cfg: RootConfig, on_gpu: bool | None) -> list[str]:
    """Weight-sync transports that cannot work for the placement (docs/trainer.md, "Weight sync")."""
    method, problems = cfg.sync.method, []
    if method == "distributed" and cfg.rollout.colocate and on_gpu:
        problems.append(
            "sync.method = distributed cannot sync colocated engines on GPUs (NCCL refuses a group whose ranks share "
            "a GPU); use auto or tensor"
        )
    handles = method == "tensor" or (method == "auto" and cfg.rollout.colocate)
    unseen = _unseen_handle(cfg) if handles and _engines_on_gpu(cfg, on_gpu) else None
    if unseen is not None:
        return [*problems, _unseen_handle_problem(cfg, *unseen)]
    if method == "tensor" and not cfg.rollout.colocate and cfg.megatron.nnodes > 1:
        problems.append(
            "sync.method = tensor hands engines handles to memory on the trainer's node: it needs rollout.colocate = "
            "true or megatron.nnodes = 1"
        )
    m = cfg.megatron
    if cfg.rollout.colocate and method != "distributed" and m.pipeline_model_parallel_size > 1 and m.nnodes > 1:
        problems.append(
            "colocated engines map the weight copies of pipeline stages that may sit on another node, which tensor "
            "handles cannot reach: with megatron.nnodes > 1 use pipeline_model_parallel_size = 1 (or "
            "rollout.colocate = false)"
        )
    return problems


def _engines_on_gpu(cfg: RootConfig, on_gpu: bool | None) -> bool:
    """Whether the engines get GPUs, where a tensor handle is a CUDA IPC handle: SGLang engines unless told
    `device: cpu` or the run is known to be on CPU (as `userrl plan` plans them); embedded engines when the run is
    known to be on GPUs or they are told a CUDA device."""
    r = cfg.rollout
    if on_gpu is False:
        return False
    if r.backend == "sglang":
        return r.sglang.device != "cpu"
    return r.embedded.device.startswith("cuda") or (on_gpu is True and r.embedded.device != "cpu")


def _unseen_handle(cfg: RootConfig) -> tuple[int, int, list[int]] | None:
    """The first engine handed a tensor handle on a GPU it does not see: (engine, the actor rank whose copy it
    maps, the GPUs the engine's process sees on that TP rank's node), as global device indices; None when every
    handle is on a GPU its engine sees. Actor rank r is on device r; engine e's TP ranks on the `engine_tp` devices
    from 0 (colocated) or after the actor's, e x `engine_tp` on (`fleet.placement.plan_bundles`), each node's
    process seeing the engine's devices on its node (`fleet.sglang.sglang_env`). An engine TP rank maps the copy of
    the stage's rank on its own device, else the stage source's (`sync.roles.payload_holders`, which imports the
    config: tests/unit/test_config_checks.py holds the two to the same answer); Megatron's order puts PP outermost,
    so stage s is a contiguous block of ranks, its source first."""
    m, r = cfg.megatron, cfg.rollout
    world, per_node = m.nnodes * m.devices_per_node, m.devices_per_node
    pp = m.pipeline_model_parallel_size
    if min(world, per_node, pp, r.engine_tp) < 1 or world % (m.tensor_model_parallel_size * pp):
        return None  # the layout checks report this
    start = 0 if r.colocate else world
    per_stage = world // pp
    for stage in range(pp):
        ranks = range(stage * per_stage, (stage + 1) * per_stage)
        for e in range(r.num_engines):
            first = start + e * r.engine_tp
            for device in range(first, first + r.engine_tp):
                holder = device if device in ranks else ranks[0]
                seen = [d for d in range(first, first + r.engine_tp) if d // per_node == device // per_node]
                if holder not in seen:
                    return e, holder, seen
    return None


def _unseen_handle_problem(cfg: RootConfig, engine: int, rank: int, seen: list[int]) -> str:
    m, r = cfg.megatron, cfg.rollout
    per_node = m.devices_per_node
    which = "tensor" if cfg.sync.method == "tensor" else "auto (tensor handles for colocated engines)"
    gpus = ",".join(str(d % per_node) for d in seen)
    where = (
        f"sync.method = {which} hands engine {engine} a CUDA IPC handle to actor rank {rank}'s memory on GPU "
        f"{rank % per_node} of node {rank // per_node}, and the engine sees only GPU{'s' if len(seen) > 1 else ''} "
        f"{gpus} of node {seen[0] // per_node} (SGLang maps a handle only on a GPU it sees)"
    )
    if not r.colocate:
        return f"{where}: use sync.method = distributed, or auto, which picks it for engines on GPUs of their own"
    world = m.nnodes * per_node
    return (
        f"{where}: colocated engines on GPUs need an actor rank of every pipeline stage on the GPUs they see; keep "
        f"rollout.num_engines x rollout.engine_tp ({r.num_engines * r.engine_tp}) <= megatron.nnodes x "
        f"megatron.devices_per_node ({world}) with pipeline_model_parallel_size = 1 (the broadcast cannot serve "
        "colocated engines on GPUs either)"
    )


def _sglang_gpu_problems(cfg: RootConfig, on_gpu: bool | None) -> list[str]:
    """SGLang engines on GPUs: an engine fits in one node or spans whole nodes (--nnodes), and a colocated engine
    sizes its KV cache from the memory free when it starts, which only `megatron.offload` leaves it
    (`trainer.components.bring_up` offloads the actor before the engines start; docs/rollout.md)."""
    r, m = cfg.rollout, cfg.megatron
    problems: list[str] = []
    if r.backend != "sglang" or on_gpu is False or r.sglang.device == "cpu" or min(r.engine_tp, m.devices_per_node) < 1:
        return problems
    tp, node = r.engine_tp, m.devices_per_node
    if tp % node and node % tp:
        problems.append(
            f"rollout.engine_tp = {tp} must divide megatron.devices_per_node = {node} (the GPUs of a node) or be a "
            "multiple of it: an engine fits in one node or spans whole nodes"
        )
    if r.colocate and not m.offload:
        problems.append(
            "rollout.colocate = true with megatron.offload = false: a colocated SGLang engine sizes its KV cache "
            "once, from the GPU memory free when it starts, and only with megatron.offload has the actor left the "
            "GPU by then (rollout.sglang.mem_fraction_static would otherwise lose the actor's share); set "
            "megatron.offload = true"
        )
    return problems


def _shared_simulator_problems(cfg: RootConfig) -> list[str]:
    """The user simulator's engines on the policy engines' GPUs (`user_sim.engines.placement: policy_engines`): engine
    e sits on policy engine e's GPUs, so it has as many (the same engine_tp) and there is a policy engine for each;
    with SGLang on both sides the two memory fractions share each GPU."""
    s, r = cfg.user_sim.engines, cfg.rollout
    if not s.shares_policy_engines:
        return []
    problems = []
    if s.engine_tp != r.engine_tp or s.num_engines > r.num_engines:
        problems.append(
            f"user_sim.engines.placement = policy_engines puts simulator engine e on policy engine e's GPUs: it needs "
            f"user_sim.engines.engine_tp = rollout.engine_tp ({s.engine_tp} vs {r.engine_tp}) and "
            f"user_sim.engines.num_engines <= rollout.num_engines ({s.num_engines} vs {r.num_engines})"
        )
    sim_fraction = s.mem_fraction_static or r.sglang.mem_fraction_static
    both_sglang = (s.backend or r.backend) == "sglang" == r.backend
    if both_sglang and sim_fraction + r.sglang.mem_fraction_static > 1:
        problems.append(
            f"user_sim.engines.placement = policy_engines: the simulator's and the policy's SGLang engines share each "
            f"GPU, and user_sim.engines.mem_fraction_static ({sim_fraction:g}) + rollout.sglang.mem_fraction_static "
            f"({r.sglang.mem_fraction_static:g}) is more than the whole GPU"
        )
    return problems


def _mode_problems(cfg: RootConfig) -> list[str]:
    """Asynchronous rollouts overlap the engines with the trainer: they need devices of their own and new weights."""
    mode, problems = cfg.rollout.mode, []
    if mode != "sync" and cfg.rollout.colocate:
        problems.append(
            f"rollout.mode = {mode} runs the engines while the actor trains: it needs rollout.colocate = false "
            "(colocated engines release their devices to the actor)"
        )
    if mode != "sync" and not cfg.sync.enabled:
        problems.append(
            f"rollout.mode = {mode} with sync.enabled = false: the engines never get new weights, so every turn's "
            "staleness grows past rollout.max_staleness; use rollout.mode = sync for the negative control"
        )
    if cfg.rollout.partial and mode == "sync":
        problems.append(
            "rollout.partial = true needs rollout.mode = one_step_off (in sync mode no rollout runs during a push)"
        )
    return problems
