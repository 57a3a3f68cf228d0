"""Typed configuration sections. Each component receives only its own section.

Every field carries a one-line comment after it: `userrl config show --explain` prints it, and a test checks
that no field lacks one. Defaults describe the embedded CPU quickstart; recipes override them in YAML.
"""

from dataclasses import dataclass, field

from userrl_megatron.config.gyms import GymsConfig, UserSimConfig


@dataclass
class RunConfig:
    name: str = ""  # run name; the run directory is <output_dir>/<name>; empty: <command>-<model directory name>
    output_dir: str = "runs"  # parent folder of run directories
    seed: int = 42  # seed for data order, sampling and model initialisation
    total_steps: int = 4  # RL steps to train (one step = rollout + update + weight sync)
    device: str = "auto"  # "auto" (cuda when available), "cpu" or "cuda"
    ray_address: str = ""  # join this Ray cluster ("auto": the one on this machine); empty: a private local one


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # HF model directory, or the name of an embedded model (userrl model list)
    dtype: str = "float32"  # parameter dtype for training and rollout: float32, bfloat16 or float16
    max_context_length: int = 2048  # longest token sequence (prompt + all turns) the model is asked to handle
    tool_format: str = "auto"  # "hermes" (<tool_call> JSON), "tags" ([action] lines), "auto" (hermes if templated)


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1  # TP: shards attention heads and MLP columns across devices
    pipeline_model_parallel_size: int = 1  # PP: splits the layers into stages
    virtual_pipeline_model_parallel_size: int = 1  # interleaved PP chunks per stage (1 = no interleaving)
    context_parallel_size: int = 1  # CP: splits long sequences across devices (GPU only)
    expert_model_parallel_size: int = 1  # EP: shards MoE experts (MoE models only; experts are TP-sharded like MLPs)
    moe_aux_loss_coef: float = -1.0  # MoE load-balancing loss weight per layer (< 0: the HF router_aux_loss_coef)
    sequence_parallel: bool = False  # shard layernorm/dropout activations along the sequence with TP (GPU only)
    nnodes: int = 1  # nodes running actor ranks
    devices_per_node: int = 1  # actor ranks per node (GPUs, or processes on CPU)
    transformer_impl: str = "auto"  # "auto" (Transformer Engine when present), "transformer_engine" or "local"
    use_distributed_optimizer: bool = True  # shard optimizer state across data-parallel ranks (ZeRO-1)
    overlap_grad_reduce: bool = False  # reduce gradient buckets during the last micro-batch's backward (same result)
    micro_batch_tokens: int = 4096  # token budget of one micro-batch (episodes are packed up to this)
    recompute: str = "none"  # activation recompute in the backward: "none", "selective" (modules) or "full" (layers)
    recompute_modules: list[str] = field(default_factory=lambda: ["mlp"])  # selective: "mlp", "layernorm" (TE)
    recompute_num_layers: int = 0  # full: layers per pipeline stage recomputed, the rest kept (0 = every layer)
    offload: bool = False  # move params, grads and optimizer state off the device while the engines generate
    lr: float = 1.0e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the cosine schedule
    lr_schedule: str = "constant"  # "constant", "linear" or "cosine" (after warmup)
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup from 0 to lr
    lr_decay_steps: int = 0  # optimizer step at which linear/cosine decay reaches min_lr (> lr_warmup_steps)
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1.0e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this value (0 disables)


@dataclass
class SGLangConfig:
    mem_fraction_static: float = 0.5  # fraction of GPU memory SGLang reserves for weights and KV cache
    enable_memory_saver: bool = True  # lets engines release memory while actors train (colocated mode)
    base_port: int = 30000  # first HTTP port; engine i listens on base_port + i
    extra_args: list[str] = field(default_factory=list)  # extra `sglang.launch_server` arguments, passed verbatim
    host: str = "127.0.0.1"  # bind address of the SGLang servers (0.0.0.0 to reach them from other nodes)
    startup_timeout_s: float = 900.0  # how long to wait for a launched server's /health_generate to answer 200
    python: str = ""  # SGLang's interpreter; "" = on CPU .venv-sglang/bin/python if present, else this one
    device: str = "auto"  # "auto" (cuda when the engine was given a GPU, else cpu), "cpu" or "cuda"
    max_total_tokens: int = 0  # KV-cache size in tokens (0 = SGLang sizes it from memory; set it on CPU)
    context_length: int = 0  # longest prompt + output served (--context-length); 0 = the model's
    enable_weights_cpu_backup: bool = False  # keep weights across memory release (forced on: colocated with sync off)
    enable_return_routed_experts: bool = False  # MoE: record routing for return_routed_experts (on: routing replay)
    release_cuda_graph: bool = False  # colocated: a release frees the CUDA-graph pool (slime's env; prefill graphs off)
    constrained_json_disable_any_whitespace: bool = False  # json_schema output compact (--constrained-json-...)
    constrained_json_max_whitespace_cnt: int = 0  # --constrained-json-max-whitespace-cnt (xgrammar); 0 = unbounded


@dataclass
class EmbeddedServerConfig:
    host: str = "127.0.0.1"  # bind address of `userrl serve` (loopback unless other hosts must reach it)
    base_port: int = 0  # first HTTP port (engine i: base_port + i); 0 = free ports picked at each start
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda" or "cuda:N"
    context_length: int = 0  # longest prompt + output served; 0 = the model's max_position_embeddings
    max_running_requests: int = 64  # requests decoded together in one batched forward
    max_prefill_tokens: int = 8192  # prompt tokens prefilled per scheduler iteration (at least one request)
    prefix_cache_tokens: int = 16384  # tokens of finished sequences whose KV is kept for reuse (0 disables)
    random_seed: int = 0  # seed of sampled requests that carry no sampling_seed
    threads: int = 0  # torch CPU threads of an engine; 0 = cores / num_engines (half in one_step_off; Ray gave 1)
    cpu_linear: str = "onednn"  # float32 linear layers on CPU: "onednn" (faster at decode's row counts) or "torch"
    enable_return_routed_experts: bool = False  # MoE: /generate may return routed_experts (SGLang flag of that name)
    enable_weights_cpu_backup: bool = False  # keep weights across a release (else dropped until a push, as SGLang)
    health_check_timeout_s: float = 20.0  # /health answers 503 when no forward completes within this time
    startup_timeout_s: float = 300.0  # how long to wait for a launched server's /health_generate to answer 200
    control_timeout_s: float = 30.0  # longest wait of a blocking control call: group join, each broadcast, disk read
    max_request_bytes: int = 67108864  # largest request body (64 MiB: weight payloads); larger gets 413 unread
    max_generate_request_bytes: int = 8388608  # largest /generate or OpenAI body (8 MiB: 1M characters escaped)
    max_top_logprobs_num: int = 20  # top log-probs per position /generate returns (OpenAI's bound; 0 = vocabulary)
    idle_timeout_s: float = 60.0  # a connection without complete request headers this long is closed
    body_timeout_s: float = 60.0  # a request body must arrive within this (else 408, connection closed)
    max_connections: int = 1024  # open connections (at most a quarter of the open-file limit); past it idle ones close
    max_prompt_chars: int = 1000000  # longest text prompt (a chat's messages together), refused before tokenising
    weight_dirs: list[str] = field(default_factory=list)  # where /update_weights_from_disk may load; [] = refused
    max_weight_payload_bytes: int = 0  # tensors of one /update_weights_from_tensor payload; 0 = 8 B/parameter, >= 1 GiB
    constrained_json_disable_any_whitespace: bool = False  # json_schema output compact (SGLang flag of that name)
    constrained_json_max_whitespace_cnt: int = 0  # most whitespace characters in a row in json_schema output; 0 = any


@dataclass
class RolloutConfig:
    backend: str = "embedded"  # "embedded" (PyTorch engine server of this project) or "sglang"
    num_engines: int = 1  # rollout engine servers in the pool
    engine_tp: int = 1  # tensor-parallel size of each engine (SGLang)
    colocate: bool = False  # engines share devices with the actors and take turns (GPU)
    mode: str = "sync"  # "sync" (rollout, train, push) or "one_step_off" (next step's rollout runs while this trains)
    max_staleness: int = 1  # groups with a turn lagging the trainer's weights by more versions are dropped
    partial: bool = False  # one_step_off: push at the end of training, aborting in-flight turns (redone on new weights)
    over_sample_groups: int = 0  # extra groups in flight; a step trains on the first to finish with unequal scores
    prompts_per_step: int = 4  # tasks sampled per RL step
    n_samples_per_prompt: int = 4  # episodes per task (the GRPO group size)
    max_turns: int = 8  # assistant turns per episode
    max_prompt_tokens: int = 1024  # longest initial prompt (system + user + tool schema)
    max_response_tokens: int = 1024  # token budget of everything after the prompt, all turns together
    max_new_tokens_per_turn: int = 256  # generation limit of one assistant turn
    reply_without_tool_call: str = ""  # reply with no tool call or tag: "end" the episode, or "action"; "" = the task's
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling threshold
    top_k: int = -1  # top-k sampling (-1 disables)
    reward_in_feedback: bool = True  # append "Reward: x" to the gym feedback shown to the policy (UserRL)
    max_concurrent_episodes: int = 64  # episodes in flight per engine
    request_timeout_s: float = 600.0  # timeout of one generate request
    health_check_interval_s: float = 10.0  # seconds between the pool's engine health checks (0 disables)
    engine_stall_timeout_s: float = 300.0  # a live engine with no progress for this long is wedged (restarted)
    engine_restart_timeout_s: float = 1800.0  # how long a weight sync waits for dead engines to come back
    engine_max_restarts: int = 3  # failed restarts in a row (no request served between) before an engine is given up
    generate_failovers: int = 2  # times one generate request moves to another engine after its engine failed
    max_infra_failure_rate: float = 0.5  # a step with more episodes lost to engine/simulator failures is not trained
    max_infra_failed_steps: int = 3  # that many such steps in a row stop the run (the infrastructure is down)
    router: str = "none"  # "none" (the pool routes, sticky per episode) or "sglang" (sglang-router, generation only)
    router_policy: str = "round_robin"  # sglang-router policy: round_robin, random, cache_aware or power_of_two
    api_key_env: str = "USERRL_ENGINE_API_KEY"  # variable holding the engines' and router's key; unset: random per run
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # SGLang server settings (backend: sglang)
    embedded: EmbeddedServerConfig = field(default_factory=EmbeddedServerConfig)  # embedded server (backend: embedded)


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo_multiturn"  # advantage estimator (registry name): grpo, grpo_multiturn
    gamma: float = 0.8  # discount of R2G turn credits and R2G trajectory scores
    turn_level: str = "Equalized"  # turn credit: "Equalized", "R2G" (reward-to-go) or "EM" (exponential map)
    trajectory_score: str = "Sum"  # trajectory score: "Sum" (mean turn reward, 4 dp) or "R2G" (discounted)
    norm_by_std: bool = True  # divide group-centred scores by the group std (False = Dr.GRPO style)
    eps: float = 1.0e-6  # added to the group std
    policy_loss: str = "ppo_clip"  # policy loss (registry name)
    clip_low: float = 0.2  # PPO clip below 1 (ratio >= 1 - clip_low)
    clip_high: float = 0.2  # PPO clip above 1 (ratio <= 1 + clip_high); > clip_low is "clip-higher"
    dual_clip_c: float = 3.0  # dual-clip bound for negative advantages (<= 1 disables)
    loss_agg: str = "token-mean"  # "token-mean", "seq-mean-token-sum" or "seq-mean-token-mean"
    kl_coef: float = 0.0  # weight of the KL(policy || reference) penalty in the loss (0 = no reference model)
    kl_estimator: str = "k3"  # KL estimator: k1, k2 or k3 (its penalty bounded to ±10 per token, as UserRL's)
    entropy_coef: float = 0.0  # weight of the entropy bonus
    tis_cap: float = -1.0  # truncated importance sampling cap (0 disables; -1: 2.0 if rollout.mode is async, else 0)
    ppo_epochs: int = 1  # passes over each step's episodes
    mini_batches_per_step: int = 1  # optimizer steps per RL step (episodes split evenly)
    drop_equal_score_groups: bool = False  # skip groups whose scores are all equal (zero advantage)
    user_sim_failure: str = "mask"  # user-simulator failures: "drop" the episode, "mask" (in baseline, no loss), "keep"
    routing_replay: str = "none"  # MoE: "rollout" replays the engines' expert choices in the trainer, "none" reroutes


@dataclass
class SyncConfig:
    enabled: bool = True  # push trained weights to the engines after each step (off = negative control)
    bucket_mb: int = 512  # bucket size of the broadcast
    direct: bool = True  # large contiguous HF tensors from their own memory; buckets in the per-tensor format
    method: str = "auto"  # weight transport: auto (tensor if rollout.colocate, else distributed), distributed, tensor
    verify: bool = False  # check every sync (engine weights read back vs the export); the first sync is always checked


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # save every k steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept; older ones are deleted after a successful save
    save_optimizer: bool = True  # save Adam's state too (3x the fp32 weights); off: a resume restarts its moments
    optimizer_format: str = "dp_reshardable"  # "dp_reshardable" (no gathering) or "fully_reshardable" (any layout)
    load_optimizer: bool = True  # resume Adam's state when the checkpoint has it (false: the weights only)
    async_save: bool = False  # stage tensors in host memory, write the files on a thread while training goes on
    save_hf: bool = True  # also export Hugging Face safetensors at the end of training
    resume: str = "auto"  # "auto" (from the run's latest checkpoint), "disable", or a checkpoint directory


@dataclass
class LoggingConfig:
    backends: list[str] = field(default_factory=lambda: ["console"])  # console, wandb, tensorboard (jsonl is always on)
    project: str = "userrl_megatron"  # wandb project
    wandb_mode: str = "offline"  # wandb mode: offline, online or disabled
    wandb_entity: str = ""  # wandb entity (team); empty = default
    level: str = "INFO"  # Python logging level
    rollout_dump_every: int = 1  # write episodes to rollouts/step_N.jsonl every k steps (0 disables)
    rollout_dump_count: int = 16  # episodes written per dump


# UserRL's evaluation-time gym settings (UserRL's eval/eval.py, build_env), applied by `userrl eval`.
EVAL_GYMS = (
    "travel.search_correct_reward=0.2",
    "travel.preference_correct_reward=0.6",
    "travel.one_choice_per_aspect=true",
    "turtle.success_threshold=1.0",
    "search.judge=llm",
)


@dataclass
class EvalConfig:
    every_steps: int = 0  # evaluate on the test mixture every k steps (0 disables)
    max_tasks: int = 32  # tasks per evaluation: the first N of each gyms.test source (0 = all)
    n_samples_per_prompt: int = 1  # episodes per task (pass@k / avg@k; `userrl eval --samples`)
    temperature: float = 0.0  # sampling temperature of evaluation episodes
    before_training: bool = False  # also evaluate the initial policy (logged as step 0) for a before/after score
    max_turns: int = 0  # assistant turns per episode in `userrl eval` (0 = rollout.max_turns; UserRL's protocol: 16)
    reward_in_feedback: bool = False  # `userrl eval` appends "Reward: x" to gym feedback (UserRL's eval.py does not)
    gym_settings: list[str] = field(default_factory=lambda: list(EVAL_GYMS))  # gyms.* overrides of `userrl eval`
    out_dir: str = ""  # output directory of `userrl eval` (empty = <run.output_dir>/<run.name>/eval)
    max_concurrent_episodes: int = 0  # episodes in flight in `userrl eval` (0 = the rollout pool's concurrency)
    retries: int = 2  # `userrl eval` plays an episode again this many times after an engine or simulator failure
    endpoint: str = ""  # OpenAI-compatible chat endpoint as the policy (e.g. http://host:8000/v1); empty = model.path
    api_model: str = ""  # model name sent to `endpoint`
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's API key ("none": no auth)
    api_tool_choice: str = "auto"  # tool_choice sent to `endpoint`: "auto" or "required"
    engine_url: str = ""  # an already-running engine (native /generate API) as the policy; model.path is its tokenizer


EXPERT_FUNCTION = "expert:function-procedural"  # scripted FunctionGym expert episodes (userrl_megatron/sft/experts.py)


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=lambda: [EXPERT_FUNCTION])  # .jsonl / .parquet, or expert:<source>
    val_files: list[str] = field(default_factory=list)  # rows of the validation loss (same forms; expert: test split)
    expert_tasks: int = 0  # tasks an expert:<source> entry plays (0 = every task of its split)
    val_max_rows: int = 0  # validation samples kept: the first N of val_files (0 = all)
    epochs: int = 1  # passes over the training rows
    batch_tokens: int = 8192  # tokens per optimizer step: whole conversations packed up to this budget
    max_tokens: int = 0  # longest conversation kept (longer rows are rejected); 0 = model.max_context_length
    lr: float = 1.0e-5  # peak learning rate (replaces megatron.lr)
    min_lr: float = 0.0  # floor of the linear / cosine decay, reached one step after the last
    lr_schedule: str = "cosine"  # after warm-up: "constant", "linear" or "cosine" decay towards min_lr
    warmup_ratio: float = 0.1  # fraction of the optimizer steps of linear warm-up from 0 (UserRL: 0.1)
    grad_clip: float = 1.0  # clip the global gradient norm to this value (0 disables; replaces megatron.grad_clip)
    val_every_steps: int = 0  # validation loss every k optimizer steps (always before the first and after the last)
    save_every_steps: int = 0  # checkpoint every k optimizer steps (0 = only at the end)


@dataclass
class PlanConfig:
    device_memory_gb: float = 80.0  # GiB of one GPU that `userrl plan` checks (H100 80GB: 79.6, H200: 140.4)
    context_gb: float = 1.0  # GiB each process holds on a GPU whatever it does: CUDA context, NCCL, allocator
    engine_runtime_gb: float = 3.0  # GiB an engine uses generating, beyond weights and KV: CUDA graphs, activations
    host_memory_gb: float = 1024.0  # GiB of pinned memory a node may hold: offload, saves, KL copy (DGX H100: 2048)


@dataclass
class RootConfig:
    run: RunConfig = field(default_factory=RunConfig)  # run identity, seed, length, devices
    model: ModelConfig = field(default_factory=ModelConfig)  # policy model
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # Megatron actor: parallelism and optimizer
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # rollout engines and episode limits
    gyms: GymsConfig = field(default_factory=GymsConfig)  # task sources, their data, each registered gym's settings
    user_sim: UserSimConfig = field(default_factory=UserSimConfig)  # LLM user simulator / judge endpoint
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # advantages and policy loss
    sync: SyncConfig = field(default_factory=SyncConfig)  # trainer -> engine weight broadcast
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoints and resume
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # metrics backends and rollout dumps
    eval: EvalConfig = field(default_factory=EvalConfig)  # periodic evaluation
    plan: PlanConfig = field(default_factory=PlanConfig)  # devices `userrl plan` checks the run against
    sft: SFTConfig = field(default_factory=SFTConfig)  # supervised fine-tuning (`userrl sft`)
