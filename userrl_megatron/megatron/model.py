"""Megatron `GPTModel` chunks built from a Hugging Face config (Llama, Qwen2, Qwen3, Qwen3-MoE), and their weights.

The layer spec is Transformer Engine's when TE and CUDA are available (and `megatron.transformer_impl`
allows it), Megatron's local spec otherwise, with torch SDPA as its core attention (`attention.py`); the
choice is logged. The vocabulary is padded to a multiple
of lcm(128, TP) (`convert.arch.padded_vocab_size`); the padded rows are zero and masked out of every
softmax (`logits.py`), so log-probs equal the HF model's.

Qwen3-MoE layers are Megatron MoE layers: a softmax top-k router (HF's `norm_topk_prob` is Megatron's
softmax over the top-k logits, its absence a softmax over all experts before the top-k), experts computed one
after the other (SequentialMLP) on the local spec and as grouped GEMMs (TEGroupedMLP) with Transformer Engine,
tokens exchanged between expert-parallel ranks by the all-to-all dispatcher, and the load-balancing loss
(`moe_settings`) applied per layer. See docs/moe.md.

Each pipeline stage holds `virtual_pipeline_model_parallel_size` chunks. Parameter names inside a chunk
number layers from 0; `global_name` turns them into the model-wide names the conversion rules use.
"""

import importlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture, padded_vocab_size
from userrl_megatron.convert.rules import Converter, Split
from userrl_megatron.convert.sharding import shard
from userrl_megatron.megatron import kernels
from userrl_megatron.megatron.attention import SDPAttention

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_PREFIX = "decoder.layers."
# apex's CUDA extension behind Megatron's gradient accumulation fusion: megatron-core's
# `tensor_parallel/layers.py` imports it by this name, and its plain ColumnParallelLinear (the output layer, even
# with Transformer Engine's layer spec) raises at construction when the fusion is on and the import failed.
FUSION_KERNEL = "fused_weight_gradient_mlp_cuda"


def recompute_settings(cfg: MegatronConfig) -> dict[str, object]:
    """`megatron.recompute` as TransformerConfig fields: selective recomputes `recompute_modules` (under flash
    attention "mlp" and "layernorm" are what free memory); full recomputes whole layers, every one ("uniform",
    one at a time) or the first `recompute_num_layers` of each stage ("block"), keeping the others."""
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(cfg.recompute_modules)}
    if cfg.recompute == "full":
        n = cfg.recompute_num_layers
        return {
            "recompute_granularity": "full",
            "recompute_method": "block" if n else "uniform",
            "recompute_num_layers": n or 1,
        }
    return {}


def aux_loss_coef(arch: Architecture, cfg: MegatronConfig) -> float:
    """The load-balancing loss coefficient: `megatron.moe_aux_loss_coef`, or the HF config's when it is < 0."""
    return arch.router_aux_loss_coef if cfg.moe_aux_loss_coef < 0 else cfg.moe_aux_loss_coef


def moe_settings(arch: Architecture, cfg: MegatronConfig, use_te: bool) -> dict[str, object]:
    """TransformerConfig fields of a mixture-of-experts model (none for a dense one)."""
    if not arch.is_moe:
        return {}
    coef = aux_loss_coef(arch, cfg)
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_top_k,
        "moe_router_score_function": "softmax",
        # HF: softmax over all experts, top-k, renormalised when norm_topk_prob. Megatron: top-k of the logits then
        # a softmax over them (= renormalised), or with pre_softmax a softmax over all then top-k (= not).
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if coef > 0 else "none",
        "moe_aux_loss_coeff": coef,
        "moe_grouped_gemm": use_te,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
        "expert_tensor_parallel_size": cfg.tensor_model_parallel_size,
    }


def use_transformer_engine(impl: str) -> bool:
    """Whether to build with the Transformer Engine spec (`megatron.transformer_impl`: auto, TE, local)."""
    available = HAVE_TE and torch.cuda.is_available()
    if impl == "transformer_engine" and not available:
        raise ConfigError("megatron.transformer_impl = transformer_engine needs CUDA and Transformer Engine installed")
    chosen = available and impl != "local"
    reason = {True: "available", False: "unavailable" if not available else "disabled by transformer_impl"}
    spec = "transformer_engine" if chosen else "local (torch SDPA attention)"
    log.info("layer spec: %s (Transformer Engine %s)", spec, reason[available])
    return chosen


def importable(module: str) -> bool:
    """Whether `import module` succeeds here (the test megatron-core itself makes: ImportError means no)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def gradient_accumulation_fusion(use_te: bool, kernel_importable: Callable[[str], bool] = importable) -> bool:
    """Whether to fuse weight-gradient accumulation into the GEMMs: with Transformer Engine, and only when apex's
    kernel (`FUSION_KERNEL`) imports, since Megatron's output layer needs it. Without it, logs one line saying so."""
    if not use_te:
        return False
    if kernel_importable(FUSION_KERNEL):
        return True
    log.warning(
        "gradient accumulation fusion: off, apex's %s kernel is not importable (Megatron's output layer needs "
        "it): weight gradients go to the fp32 main_grad in a separate add (more memory traffic, same result). "
        "To get it, build NVIDIA apex with its CUDA extensions: pip install -v --no-build-isolation "
        '--config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" '
        "git+https://github.com/NVIDIA/apex",
        FUSION_KERNEL,
    )
    return False


def transformer_config(
    arch: Architecture, cfg: MegatronConfig, dtype: torch.dtype, use_te: bool, initialize: bool = False
) -> TransformerConfig:
    """Megatron's TransformerConfig for `arch` under the parallel layout and options of `cfg`. The stand-in kernels
    go in first: the config refuses `apply_rope_fusion` when no fused RoPE is installed."""
    kernels.provide()
    return TransformerConfig(**transformer_fields(arch, cfg, dtype, use_te, initialize))


def transformer_fields(
    arch: Architecture, cfg: MegatronConfig, dtype: torch.dtype, use_te: bool, initialize: bool = False
) -> dict[str, object]:
    """The fields of `transformer_config` (Megatron checks them when the config is made: with `use_te`, only
    where Transformer Engine is installed)."""
    on_gpu = torch.cuda.is_available()
    vpp = cfg.virtual_pipeline_model_parallel_size
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cfg.context_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=initialize,
        variable_seq_lengths=True,  # episodes differ in length: pipeline stages exchange shapes
        moe_token_dispatcher_type="alltoall",  # MoE tokens between EP ranks; the default rejects variable lengths
        calculate_per_token_loss=True,  # losses come back as sums + counts, normalised over the whole batch
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        masked_softmax_fusion=use_te,
        apply_rope_fusion=True,  # Transformer Engine's kernel, or kernels.py's where TE is absent
        gradient_accumulation_fusion=gradient_accumulation_fusion(use_te),  # weight grads straight into main_grad
        deallocate_pipeline_outputs=on_gpu,
        **recompute_settings(cfg),
        **moe_settings(arch, cfg, use_te),
    )


def build_chunks(
    arch: Architecture, cfg: MegatronConfig, dtype: torch.dtype, use_te: bool, initialize: bool = False
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), on its device, not yet wrapped in DDP.

    `initialize` runs Megatron's random initialisation (skip it when weights are loaded next)."""
    config = transformer_config(arch, cfg, dtype, use_te, initialize)
    experts = arch.num_experts or None
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=use_te and arch.is_moe, qk_layernorm=arch.qk_norm
        )
    else:
        spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    vocab = padded_vocab_size(arch.vocab_size, cfg.tensor_model_parallel_size)
    vpp = cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            vp_stage=vp_stage,
        )
        if not use_te:
            hold_norms_in(model, dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def hold_norms_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the local spec's norms to the model dtype.

    Megatron's `WrappedTorchNorm` builds `torch.nn.RMSNorm` in torch's default dtype (fp32) whatever
    `params_dtype` says, while Transformer Engine's norms, the HF checkpoint and the engine all hold them in the
    model dtype: left in fp32, a bf16 actor trains and exports norm weights the engine can only round."""
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(dtype)


SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def global_name(chunk: torch.nn.Module, local_name: str) -> str:
    """The model-wide name of a chunk parameter: decoder layer indices offset by the chunk's first layer, and
    expert indices offset by this expert-parallel rank's first expert."""
    if not local_name.startswith(LAYER_PREFIX):
        return local_name
    index, rest = local_name[len(LAYER_PREFIX) :].split(".", 1)
    layer: TransformerLayer = chunk.get_submodule(f"{LAYER_PREFIX}{int(index)}")
    experts = getattr(layer.mlp, "local_expert_indices", None)
    if experts is not None:
        rest = with_expert(rest, lambda local: experts[local])
    return f"{LAYER_PREFIX}{layer.layer_number - 1}.{rest}"


def with_expert(name: str, renumber: Callable[[int], int]) -> str:
    """`name` (a layer parameter's name, or a whole one) with its expert index `j` replaced by `renumber(j)`;
    names of non-expert parameters come back unchanged."""
    prefix = ""
    if name.startswith(LAYER_PREFIX):
        index, name = name[len(LAYER_PREFIX) :].split(".", 1)
        prefix = f"{LAYER_PREFIX}{index}."
    name = SEQUENTIAL_EXPERT.sub(lambda m: f"mlp.experts.local_experts.{renumber(int(m.group(1)))}.", name)
    name = GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{renumber(int(m.group(2)))}", name)
    return prefix + name


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter (chunk-local or global name) belongs to one routed expert."""
    rest = name[len(LAYER_PREFIX) :].split(".", 1)[-1] if name.startswith(LAYER_PREFIX) else name
    return bool(SEQUENTIAL_EXPERT.match(rest) or GROUPED_EXPERT.match(rest))


def named_global_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every parameter of every chunk, in chunk order."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            yield global_name(chunk, name), param


def source_name(name: str, arch: Architecture) -> str:
    """The rule name a parameter is loaded from: a tied output layer (last stage, PP > 1) is the embedding."""
    if arch.tied_embeddings and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def check_split(name: str, param: torch.nn.Parameter, split: Split, tp: int) -> None:
    """Fail if Megatron shards a parameter differently from what the conversion table says."""
    if tp == 1:
        return
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    expected_dim = {Split.ROW: 1, Split.REPLICATED: None}.get(split, 0)
    actual_dim = getattr(param, "partition_dim", None) if sharded else None
    if actual_dim != expected_dim:
        raise RuntimeError(
            f"{name}: the conversion table says {split.value} (partition dim {expected_dim}), "
            f"Megatron shards it on dim {actual_dim}"
        )


@torch.no_grad()
def load_full_weights(
    chunks: list[torch.nn.Module], full: Mapping[str, torch.Tensor], converter: Converter, tp_rank: int, tp: int
) -> None:
    """Copy this rank's shard of each full Megatron tensor (`full[global name]`) into the chunks' parameters."""
    vocab = padded_vocab_size(converter.arch.vocab_size, tp)
    for name, param in named_global_parameters(chunks):
        key = source_name(name, converter.arch)
        split = converter.split_of(key)
        check_split(name, param, split, tp)
        local = shard(full[key], split, tp_rank, tp, padded_rows=vocab)
        if local.shape != param.shape:
            raise ValueError(
                f"{name}: shard of shape {tuple(local.shape)} for a parameter of shape {tuple(param.shape)}"
            )
        param.copy_(local)


class TensorLookup(Protocol):
    """Tensors by name: a mapping, or `convert.hf_io.HFWeights` (which reads each one from disk)."""

    def __getitem__(self, name: str, /) -> torch.Tensor: ...


class HFSource(Mapping[str, torch.Tensor]):
    """Full Megatron tensors computed on demand from HF tensors (read lazily from disk by the caller's mapping)."""

    def __init__(self, hf: TensorLookup, converter: Converter) -> None:
        self.hf, self.converter = hf, converter

    def __getitem__(self, name: str) -> torch.Tensor:
        rule, _ = self.converter.rule_for(name)
        return rule.to_mcore([self.hf[h] for h in self.converter.hf_sources(name)], self.converter.arch)

    def __iter__(self) -> Iterator[str]:
        return iter(self.converter.mcore_names())

    def __len__(self) -> int:
        return len(self.converter.mcore_names())
