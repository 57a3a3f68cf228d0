"""Bytes per device of what a run holds: the Megatron actor's state and temporaries, an engine's weights and KV.

Pure arithmetic from the model's shape (`convert.arch.Architecture`) and the config sections; every number is a
product of a count and a width that the docstrings name, so a plan can be checked by hand (docs/plan.md).
"""

from dataclasses import dataclass

from userrl_megatron.config.schema import MegatronConfig, PlanConfig, RolloutConfig
from userrl_megatron.convert.arch import Architecture

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
        per_token, replicated = _layer_activation_widths(arch, recomputed)
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


def _layer_activation_widths(arch: Architecture, recomputed: tuple[str, ...] = ()) -> tuple[int, int]:
    """Values per token one layer stores for its backward, and how many of them only sequence parallelism shards.

    Attention: norm input and output (2h), q (heads x d), k and v (2 x kv heads x d), the attention output
    (heads x d). MLP: norm input and output (2h), gate and up (2f), the SwiGLU product (f); for a mixture of experts
    those three per routed expert plus the token's dispatched copy and the expert's output (top-k x (3 x expert
    width + 2h)). The h-wide norm
    tensors are replicated across TP ranks unless sequence parallelism splits them along the sequence.
    Selective recompute of "mlp" drops gate, up and product; of "layernorm" the two norm outputs; "core_attn"
    drops nothing, since flash attention never stores the attention scores."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    mlp = 0 if "mlp" in recomputed else 3 * arch.ffn_hidden_size
    if arch.is_moe and "mlp" not in recomputed:  # each token visits top-k experts
        mlp = arch.moe_top_k * (3 * arch.moe_ffn_hidden_size + 2 * h)
    norms = 2 * h if "layernorm" in recomputed else 4 * h
    return norms + 2 * q + 2 * kv + mlp, norms


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of one rollout engine (SGLang's accounting)."""

    weights: int  # the whole model in the serving dtype over the engine's TP ranks
    kv_token: int  # KV-cache bytes per token on one GPU (K and V of every layer, this GPU's KV heads)
    runtime: int  # CUDA graphs and decode activations while generating (`plan.engine_runtime_gb`)


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


def sglang_kv_pool(free_after_weights: int, device: int, mem_fraction_static: float) -> int:
    """Bytes SGLang gives its KV pool at start: what is free once its weights are loaded, less the share of the
    device it keeps for everything else, `(1 - mem_fraction_static) x device`. Memory another process holds at
    that moment is not free: an actor still on the GPU shrinks the pool for the whole run."""
    return free_after_weights - int(device * (1 - mem_fraction_static))
