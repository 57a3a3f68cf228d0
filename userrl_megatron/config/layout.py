"""The parallel layout's rules, as problem lists (pure Python: no torch, no Megatron).

One place for what the Megatron actor accepts, so that `config validate`, `userrl train` before start-up and
the actor ranks themselves (`megatron.parallel.check_layout`, `check_model_layout`) refuse the same layouts
with the same words.
"""

from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture

# Submodules whose activations `megatron.recompute: selective` can recompute in the backward (dense models).
# "core_attn" saves nothing under flash attention, which never stores the attention scores.
RECOMPUTE_MODULES = ("mlp", "layernorm", "core_attn")


def layout_problems(cfg: MegatronConfig, world_size: int, on_gpu: bool | None) -> list[str]:
    """What stops `cfg`'s parallel sizes from tiling `world_size` actor ranks.

    `on_gpu`: whether the ranks get CUDA devices; None when not known yet (GPU-only features are then not
    judged)."""
    sizes = {
        "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_model_parallel_size,
        "context_parallel_size": cfg.context_parallel_size,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
    }
    problems = [f"megatron.{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if problems:
        return problems
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    if world_size % (tp * pp * cp):
        problems.append(
            f"megatron: tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
            f"{tp} x {pp} x {cp} = {tp * pp * cp} does not divide the actor device count megatron.nnodes x "
            f"megatron.devices_per_node = {world_size}, so no data-parallel size makes tp*pp*cp*dp equal it"
        )
    if cfg.virtual_pipeline_model_parallel_size > 1 and pp < 3:
        # With two stages the previous and the next stage are the same rank, and the interleaved schedule's
        # simultaneous sends in both directions can be matched to the wrong receives (wrong activations,
        # silently): the actor refuses it, so refuse it here too.
        problems.append(
            f"megatron.virtual_pipeline_model_parallel_size = {cfg.virtual_pipeline_model_parallel_size} needs "
            f"pipeline_model_parallel_size >= 3, got {pp} (interleaving over 2 stages can pair sends and "
            "receives wrongly)"
        )
    ep = cfg.expert_model_parallel_size
    dp = world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else 0
    if ep > 1 and dp and (dp * cp) % ep:
        problems.append(
            f"megatron.expert_model_parallel_size = {ep} must divide the data-parallel size {dp}"
            + (f" x context_parallel_size {cp}" if cp > 1 else "")
            + f" (experts are spread over data-parallel ranks: {world_size} devices / (tp {tp} x pp {pp} x cp {cp}))"
        )
    unknown = sorted(set(cfg.recompute_modules) - set(RECOMPUTE_MODULES))
    if unknown:
        problems.append(f"megatron.recompute_modules: {unknown} not among {list(RECOMPUTE_MODULES)}")
    no_te = on_gpu is False or cfg.transformer_impl == "local"
    if cfg.recompute == "selective" and "layernorm" in cfg.recompute_modules and no_te:
        # Megatron-core 0.19's CheckpointWithoutOutput, which recomputes the norms, reads Transformer Engine's
        # FP8 state whatever the precision
        problems.append('megatron.recompute_modules: "layernorm" needs the Transformer Engine layer spec (CUDA)')
    if cfg.sequence_parallel and tp < 2:
        problems.append("megatron.sequence_parallel needs tensor_model_parallel_size >= 2")
    if on_gpu is False:
        if cp > 1:
            problems.append("megatron.context_parallel_size > 1 needs CUDA (Transformer Engine attention)")
        if cfg.sequence_parallel:
            problems.append("megatron.sequence_parallel needs CUDA (Transformer Engine or apex norms)")
    if cp > 1 and cfg.transformer_impl == "local":
        problems.append("megatron.context_parallel_size > 1 needs the Transformer Engine layer spec, not local")
    return problems


def moe_training_problems(cfg: MegatronConfig, arch: Architecture) -> list[str]:
    """What stops Megatron from *training* `arch` under `cfg` (converting and scoring work regardless)."""
    tp = cfg.tensor_model_parallel_size
    if arch.is_moe and tp > 1 and not cfg.sequence_parallel:
        return [
            f"megatron.tensor_model_parallel_size = {tp} with a mixture-of-experts model needs "
            "megatron.sequence_parallel = true (Megatron refuses to train MoE under TP without it; GPU only)"
        ]
    return []


def model_layout_problems(cfg: MegatronConfig, arch: Architecture) -> list[str]:
    """What stops `arch` from being split as `cfg` asks: heads, key/value heads and FFN over TP, layers over
    PP x VPP stages."""
    tp, pp, vpp = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.virtual_pipeline_model_parallel_size,
    )
    if min(tp, pp, vpp) < 1:
        return []  # reported by layout_problems
    problems = []
    if arch.num_heads % tp:
        problems.append(
            f"megatron.tensor_model_parallel_size = {tp} must divide the model's {arch.num_heads} attention heads"
        )
    if arch.num_kv_heads % tp:
        problems.append(
            f"megatron.tensor_model_parallel_size = {tp} must divide the model's {arch.num_kv_heads} key/value heads "
            f"(num_key_value_heads)"
        )
    ep = cfg.expert_model_parallel_size
    if ep > 1 and not arch.is_moe:
        problems.append(
            f"megatron.expert_model_parallel_size = {ep} needs a mixture-of-experts model; "
            f"{arch.family} is dense (set it to 1)"
        )
    if arch.is_moe and ep >= 1 and arch.num_experts % ep:
        problems.append(
            f"megatron.expert_model_parallel_size = {ep} must divide the model's {arch.num_experts} experts "
            "(num_experts)"
        )
    if arch.is_moe and arch.moe_ffn_hidden_size % tp:
        problems.append(
            f"megatron.tensor_model_parallel_size = {tp} must divide the model's "
            f"moe_intermediate_size {arch.moe_ffn_hidden_size} (experts are sharded over TP)"
        )
    if not arch.is_moe and arch.ffn_hidden_size % tp:
        problems.append(
            f"megatron.tensor_model_parallel_size = {tp} must divide the model's "
            f"intermediate_size {arch.ffn_hidden_size}"
        )
    if arch.num_layers % (pp * vpp):
        problems.append(
            f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp} must divide the "
            f"model's {arch.num_layers} layers"
        )
    chunk = arch.num_layers // (pp * vpp)
    if cfg.recompute == "full" and cfg.recompute_num_layers > chunk:
        problems.append(
            f"megatron.recompute_num_layers = {cfg.recompute_num_layers} exceeds the {chunk} layers of a pipeline "
            "stage (per virtual chunk)"
        )
    return problems


# Megatron's default order of the parallel dimensions, fastest-varying first ("tp-cp-ep-dp-pp"): for the dense
# groups ep drops out (tp, cp, dp, pp); the experts are laid out as (etp = tp, ep, expert dp, pp).
def rank_coordinates(cfg: MegatronConfig, rank: int, world_size: int) -> dict[str, int]:
    """Actor rank `rank`'s index in each parallel dimension, as Megatron's `RankGenerator` lays them out (the
    layout must pass `layout_problems`). Pure: what `megatron.parallel.initialize` gives that rank."""
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    ep = cfg.expert_model_parallel_size
    dp = world_size // (tp * pp * cp)
    return {
        "tp_rank": rank % tp,
        "cp_rank": rank // tp % cp,
        "dp_rank": rank // (tp * cp) % dp,
        "pp_rank": rank // (tp * cp * dp),
        "ep_rank": rank // tp % ep,
        "tp": tp,
        "cp": cp,
        "dp": dp,
        "pp": pp,
        "ep": ep,
    }


def tensor_parallel_ranks(cfg: MegatronConfig, rank: int) -> list[int]:
    """The global ranks of `rank`'s tensor-parallel group, in group order."""
    tp = cfg.tensor_model_parallel_size
    first = rank - rank % tp
    return list(range(first, first + tp))


def stage_ranks(cfg: MegatronConfig, rank: int, world_size: int) -> list[int]:
    """The global ranks of `rank`'s pipeline stage (its tensor x context x data parallel group), in order."""
    size = world_size // cfg.pipeline_model_parallel_size
    first = rank - rank % size
    return list(range(first, first + size))


def rank_device(visible: int, index: int, sharing: int) -> int | None:
    """The CUDA device a rank computes on (an index among the `visible` devices its process sees) when it is
    process `index` of `sharing` processes seeing the same devices; None without CUDA (gloo on the CPU).

    One rank per device: NCCL refuses a group in which two ranks use one GPU, so `sharing` > `visible` raises
    ConfigError."""
    from userrl_megatron.config.loader import ConfigError

    if visible == 0:
        return None
    if not 0 <= index < sharing:
        raise ValueError(f"rank index {index} out of range for {sharing} processes")
    if sharing > visible:
        raise ConfigError(
            [
                f"{sharing} actor ranks would share the {visible} CUDA device(s) their processes see, and NCCL needs "
                "one device per rank: give each rank its own GPU (CUDA_VISIBLE_DEVICES, or LOCAL_RANK and "
                "LOCAL_WORLD_SIZE as torchrun sets them), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on "
                "the CPU with gloo"
            ]
        )
    return index
