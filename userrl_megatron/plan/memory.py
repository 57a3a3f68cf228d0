"""Bytes per device of what a run holds: the Megatron actor's state and temporaries, an engine's weights and KV,
the weight sync's buckets; and the pinned host memory an actor rank keeps.

Pure arithmetic from the model's shape (`convert.arch.Architecture`) and the config sections; every number is a
product of a count and a width that the docstrings name, so a plan can be checked by hand (docs/plan.md).
"""

from dataclasses import dataclass

from userrl_megatron.config.schema import MegatronConfig, PlanConfig, RolloutConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.offload import HOST_CHUNK_BYTES, arena_bytes

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GRAD_BYTES = 4  # Megatron's grad buffers are fp32 (`grad_reduce_in_fp32`)
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master copy of 16-bit parameters
# megatron/logits.py turns at most this many logits into fp32 at a time (x, its softmax, its gradient: 3 copies);
# what stays is the logits and, in training, their gradient, both in the model dtype.
LOGIT_CHUNK_ELEMENTS = 1 << 24
LOGIT_CHUNK_BYTES = 3 * 4 * LOGIT_CHUNK_ELEMENTS


def layer_parameters(arch: Architecture) -> int:
    """Parameters of one transformer layer (attention, SwiGLU MLP or router + experts, two norms)."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * (arch.num_heads * d + 2 * arch.num_kv_heads * d) + arch.num_heads * d * h
    if arch.qkv_bias:
        attn += arch.num_heads * d + 2 * arch.num_kv_heads * d
    if arch.qk_norm:
        attn += 2 * d
    mlp = router_parameters(arch) + expert_parameters(arch) if arch.is_moe else 3 * h * arch.ffn_hidden_size
    return attn + mlp + 2 * h


def router_parameters(arch: Architecture) -> int:
    """Parameters of one layer's MoE router (replicated on every rank), 0 for a dense model."""
    return arch.num_experts * arch.hidden_size


def expert_parameters(arch: Architecture) -> int:
    """Parameters of one layer's routed experts (sharded over TP x EP), 0 for a dense model."""
    return arch.num_experts * 3 * arch.hidden_size * arch.moe_ffn_hidden_size


@dataclass(frozen=True)
class ActorMemory:
    """One Megatron rank's bytes, for the pipeline stage that holds the most (the first or the last)."""

    weights: int  # parameters in the model dtype
    grads: int  # fp32 grad buffers (whole stage shard: the distributed optimizer reduce-scatters into them)
    optimizer: int  # Adam moments (+ fp32 master weights), divided over DP x CP with the distributed optimizer
    train_activations: int  # stored for the backward of the micro-batches in flight, under the chosen recompute
    forward_activations: int  # one layer's worth: a forward-only pass keeps nothing for a backward
    train_logits: int  # the logits of one micro-batch, their gradient and one chunk's fp32 temporaries (last stage)
    forward_logits: int  # the logits and one chunk's temporaries, for a log-prob pass

    @property
    def state(self) -> int:
        return self.weights + self.grads + self.optimizer


def actor_memory(arch: Architecture, cfg: MegatronConfig, dtype: str, world: int) -> ActorMemory:
    """The worst rank of the layout `cfg` over `world` ranks (see the module docstring for the widths)."""
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    dp_cp = world // (tp * pp)  # the distributed optimizer shards over data- and context-parallel ranks
    width = DTYPE_BYTES[dtype]
    layers = -(-arch.num_layers // pp)
    ep = cfg.expert_model_parallel_size
    replicated = 2 * arch.hidden_size + router_parameters(arch)
    experts = expert_parameters(arch) // (tp * ep)
    shard = (layer_parameters(arch) - replicated - expert_parameters(arch)) // tp + replicated + experts
    embedding = arch.vocab_size * arch.hidden_size // tp
    first = layers * shard + embedding
    last = layers * shard + arch.hidden_size + (embedding if pp > 1 or not arch.tied_embeddings else 0)
    params = max(first, last) if pp > 1 else first + last - layers * shard
    master = 0 if width == 4 else MASTER_BYTES
    optimizer = params * (ADAM_BYTES + master)
    if cfg.use_distributed_optimizer:  # experts shard over the expert-data-parallel ranks, DP x CP / EP
        expert_state = layers * experts * (ADAM_BYTES + master)
        optimizer = -(-(optimizer - expert_state) // dp_cp) + -(-expert_state // max(dp_cp // ep, 1))

    tokens = -(-cfg.micro_batch_tokens // cp)

    def layer_bytes(recomputed: tuple[str, ...]) -> int:
        per_token, replicated = _layer_activation_widths(arch, recomputed, cfg.transformer_impl == "transformer_engine")
        sharded = (per_token - replicated) // tp + (replicated // tp if cfg.sequence_parallel else replicated)
        return tokens * sharded * width

    full_layer = layer_bytes(())
    if cfg.recompute == "full":  # recomputed layers keep their input; the one being recomputed holds its full set
        recomputed = cfg.recompute_num_layers or layers
        layer_input = tokens * arch.hidden_size * width // (tp if cfg.sequence_parallel else 1)
        per_micro_batch = recomputed * layer_input + (layers - recomputed) * full_layer + full_layer
    elif cfg.recompute == "selective":
        per_micro_batch = layers * layer_bytes(tuple(cfg.recompute_modules))
    else:
        per_micro_batch = layers * full_layer
    vpp = cfg.virtual_pipeline_model_parallel_size
    in_flight = pp if vpp == 1 else pp + (pp - 1) / vpp  # 1F1B; interleaving warms up (pp - 1) / vpp more
    vocab_columns = -(-arch.vocab_size // tp)
    return ActorMemory(
        weights=params * width,
        grads=params * GRAD_BYTES,
        optimizer=optimizer,
        train_activations=int(per_micro_batch * in_flight),
        forward_activations=2 * full_layer,
        train_logits=2 * tokens * vocab_columns * width + LOGIT_CHUNK_BYTES,
        forward_logits=tokens * vocab_columns * width + LOGIT_CHUNK_BYTES,
    )


def _layer_activation_widths(
    arch: Architecture, recomputed: tuple[str, ...] = (), transformer_engine: bool = False
) -> tuple[int, int]:
    """Values per token one layer stores for its backward, and how many of them only sequence parallelism shards.

    With Transformer Engine's layer spec: attention keeps the norm inputs and outputs (2h), q (heads x d), k and
    v (2 x kv heads x d) and the attention output (heads x d); the MLP its norm's input and output (2h), gate and
    up (2f) and the SwiGLU product (f). The local spec (any other `megatron.transformer_impl`: "auto" may run
    without TE) also keeps the rotated copies of q and k (q + kv) and, in its unfused SwiGLU, the SiLU and the
    product beside the fc1 output (5f): on an H200 its 10-layer Qwen3 held 4.51 GiB beside the logits at 8,192
    tokens, these widths give 4.38 GiB (docs/gpu.md). For a mixture of experts the MLP's values are per routed
    expert plus the token's dispatched copy and the expert's output (top-k x (expert widths + 2h)). The h-wide
    norm tensors are replicated across TP ranks unless sequence parallelism splits them along the sequence.
    Selective recompute of "mlp" drops the MLP's own values; of "layernorm" the two norm outputs; "core_attn"
    drops nothing, since flash attention never stores the attention scores."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    swiglu = 3 if transformer_engine else 5  # values per FFN column
    attention = 2 * q + 2 * kv if transformer_engine else 3 * q + 3 * kv
    mlp = 0 if "mlp" in recomputed else swiglu * arch.ffn_hidden_size
    if arch.is_moe and "mlp" not in recomputed:  # each token visits top-k experts
        mlp = arch.moe_top_k * (swiglu * arch.moe_ffn_hidden_size + 2 * h)
    norms = 2 * h if "layernorm" in recomputed else 4 * h
    return norms + attention + mlp, norms


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of one rollout engine (SGLang's accounting)."""

    weights: int  # the whole model in the serving dtype over the engine's TP ranks
    kv_token: int  # KV-cache bytes per token on one GPU (K and V of every layer, this GPU's KV heads)
    runtime: int  # CUDA graphs and decode activations while generating (`plan.engine_runtime_gb`), in SGLang's slack


def engine_memory(arch: Architecture, rollout: RolloutConfig, dtype: str, plan: PlanConfig) -> EngineMemory:
    """Weights and KV widths of one engine GPU at `rollout.engine_tp`."""
    tp = rollout.engine_tp
    width = DTYPE_BYTES[dtype]
    kv_heads = max(1, arch.num_kv_heads // tp)  # SGLang replicates KV heads when TP exceeds their count
    return EngineMemory(
        weights=arch.num_parameters * width // tp,
        kv_token=2 * arch.num_layers * kv_heads * arch.head_dim * width,
        runtime=int(plan.engine_runtime_gb * GIB),
    )


def sglang_kv_pool(free_after_weights: int, free_at_start: int, mem_fraction_static: float) -> int:
    """Bytes SGLang 0.5.23 gives its KV pool at start: what is free once its weights are loaded, less
    `(1 - mem_fraction_static)` of what was free before it loaded them (`pre_model_load_memory`, measured once
    torch.distributed is up, the minimum over its TP ranks: model_executor/model_runner.py:1261-1264,
    distributed/bootstrap.py:193-223; the slack and the budget: mem_cache/kv_cache_configurator.py:3007, 3038).
    It keeps that slack for its CUDA graphs and activations. Memory another process holds at its start is neither
    in the pool nor in the slack: an actor resident then shrinks both, for the engine's life."""
    return free_after_weights - int(free_at_start * (1 - mem_fraction_static))


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator allocates for a pinned tensor of `nbytes`: the next power of two (its
    default rule in torch 2.x, `ATen/core/CachingHostAllocator.h`), kept for the run once freed."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass(frozen=True)
class RankTensors:
    """Element counts of the parameter tensors of one rank on the heaviest pipeline stage (as `actor_memory`)."""

    dense: list[int]  # replicated over data-parallel ranks (attention, dense MLP, norms, router, embedding, head)
    experts: list[int]  # this rank's routed experts' tensors (replicated over DP x CP / EP)


def rank_tensors(arch: Architecture, cfg: MegatronConfig) -> RankTensors:
    """Megatron's parameter tensors of a rank: per layer the fused QKV (with its bias), the output projection,
    q/k norms, the fused gate/up and the down projection (or the router and each local expert's two), two norms;
    the embedding on the first stage, the final norm and the output layer on the last. The stage with the most
    bytes wins."""
    tp, pp, ep = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.expert_model_parallel_size
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    layer = [h * (q + 2 * kv) // tp, q * h // tp, h, h]
    layer += [(q + 2 * kv) // tp] if arch.qkv_bias else []
    layer += [d, d] if arch.qk_norm else []
    experts: list[int] = []
    if arch.is_moe:
        layer.append(arch.num_experts * h)
        fe = arch.moe_ffn_hidden_size
        experts = [2 * fe * h // tp, fe * h // tp] * (arch.num_experts // ep)
    else:
        layer += [2 * arch.ffn_hidden_size * h // tp, arch.ffn_hidden_size * h // tp]
    layers = -(-arch.num_layers // pp)
    embedding = arch.vocab_size * h // tp
    first = layer * layers + [embedding]
    last = layer * layers + [h] + ([embedding] if pp > 1 or not arch.tied_embeddings else [])
    if pp == 1:
        return RankTensors(first + last[len(layer) * layers :], experts * layers)
    return RankTensors(max(first, last, key=sum), experts * layers)


def staging_bytes(arch: Architecture, cfg: MegatronConfig, dtype: str, world: int, optimizer: bool) -> int:
    """Pinned host bytes a rank's checkpoint save leaves behind: every tensor it writes is copied to its own
    pinned buffer (`megatron/checkpoint_writer.py` in the background; Megatron's `tensor.to("cpu",
    non_blocking=True)` inline), each rounded up to a power of two and kept for the next save. The replicated
    weights are split over the data-parallel ranks (Megatron's fully parallel save, taken here as an even
    share); with the distributed optimizer each rank writes the fp32 master, exp_avg and exp_avg_sq of its shard of
    every parameter (taken as 1/(DP x CP) of it). An estimate: the real split follows Megatron's buckets."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp_cp = world // (tp * pp)
    dp_experts = max(dp_cp // cfg.expert_model_parallel_size, 1)
    width = DTYPE_BYTES[dtype]
    tensors = rank_tensors(arch, cfg)
    total = 0
    for group, replicas in ((tensors.dense, dp_cp), (tensors.experts, dp_experts)):
        total += -(-sum(pinned_bytes(n * width) for n in group) // replicas)
        if optimizer and cfg.use_distributed_optimizer:
            total += 3 * sum(pinned_bytes(4 * -(-n // replicas)) for n in group)
        elif optimizer:
            total += -(-3 * sum(pinned_bytes(4 * n) for n in group) // replicas)
    return total


@dataclass(frozen=True)
class HostMemory:
    """Pinned host bytes of one actor rank, as torch allocates them, by what may hold them (all kept for the run)."""

    offload_weights: int  # what offload copies of the weights (into chunks of HOST_CHUNK_BYTES, with the state)
    offload_state: int  # and of the optimizer state (grads are not copied)
    reference: int  # the KL reference's two copies of the weights (`algo.kl_coef` > 0), whole chunks each
    staging: int  # a checkpoint save's staging buffers with the optimizer state (`staging_bytes`)
    staging_model_only: int  # the same for a save of the model alone

    def offload(self, weights: bool, state: bool) -> int:
        """Host bytes of the offload arena once these kinds have been offloaded (whole chunks)."""
        return arena_bytes(self.offload_weights * weights + self.offload_state * state, HOST_CHUNK_BYTES)


def host_memory(arch: Architecture, cfg: MegatronConfig, dtype: str, world: int, kl: bool) -> HostMemory:
    """The pinned host memory of the worst rank of `cfg` over `world` ranks (see `HostMemory`)."""
    actor = actor_memory(arch, cfg, dtype, world)
    return HostMemory(
        offload_weights=actor.weights,
        offload_state=actor.optimizer,
        reference=2 * arena_bytes(actor.weights) if kl else 0,
        staging=staging_bytes(arch, cfg, dtype, world, optimizer=True),
        staging_model_only=staging_bytes(arch, cfg, dtype, world, optimizer=False),
    )


# megatron/export.py gathers tensor-parallel shards in flat batches of about this size (GATHER_BATCH_BYTES).
EXPORT_GATHER_BYTES = 16 * 2**20


def export_working_set(arch: Architecture, tp: int, dtype: str) -> int:
    """Device bytes the weight sync's export (`megatron/export.py`) holds beside the buckets it fills.

    TP 1: nothing (each HF tensor is copied from the parameters straight into its bucket, q, k and v as strided
    copies of the fused QKV). TP > 1: one gather's reused buffers, the rank's flat batch of shards (colocated
    sync, where every rank gathers) and the TP batches gathered from the group (a batch is `EXPORT_GATHER_BYTES`,
    or one shard of the largest tensor when that is larger); the HF tensors are filled from the gathered shards,
    never rebuilt whole."""
    if tp == 1:
        return 0
    width = DTYPE_BYTES[dtype]
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    ffn = arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    largest = max(arch.vocab_size * h, (q + 2 * kv) * h, 2 * ffn * h) * width  # one whole Megatron tensor
    return (1 + tp) * max(EXPORT_GATHER_BYTES, -(-largest // tp))


def sync_buckets(arch: Architecture, bucket_bytes: int, dtype: str) -> int:
    """Device bytes of the two buckets a weight sync keeps alive (one in flight while the next is packed, on both
    paths): the two largest it makes. A bucket is `sync.bucket_mb`, or one HF tensor when that is larger (the
    embedding, the LM head when untied, q/o projections, MLP or expert matrices)."""
    h, q = arch.hidden_size, arch.num_heads * arch.head_dim
    embedding = arch.vocab_size * h
    tensors = [embedding] * (1 if arch.tied_embeddings else 2) + [q * h] * 2
    if arch.is_moe:
        tensors += [arch.moe_ffn_hidden_size * h] * 3 + [arch.num_experts * h]
    else:
        tensors += [arch.ffn_hidden_size * h] * 3
    first, second = sorted(tensors, reverse=True)[:2]
    width = DTYPE_BYTES[dtype]
    return max(bucket_bytes, first * width) + max(bucket_bytes, second * width)
