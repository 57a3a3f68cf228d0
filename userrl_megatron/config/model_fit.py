"""Does the policy model fit the configured layout? Read from its HF config before any process starts.

The shape comes from `model.path`'s config.json, an embedded model's config (recorded, so nothing is fetched),
or, for a path that is not on this machine (a cluster path checked on a laptop), the published shape of the
models the recipes in `configs/model/` name, matched by the directory's name. A model whose shape is unknown
here is checked by the actor ranks at start-up instead.
"""

from pathlib import Path
from typing import Any

from userrl_megatron.config.layout import model_layout_problems, moe_training_problems
from userrl_megatron.config.schema import ModelConfig, RootConfig
from userrl_megatron.convert.arch import Architecture, UnsupportedModelError

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1e6}
# Published config.json shapes of the models `configs/model/*.yaml` name (keyed by lower-cased directory name).
PUBLISHED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": _QWEN3
    | {
        "num_hidden_layers": 36,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 9728,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": _QWEN3
    | {
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "qwen3-32b": _QWEN3
    | {
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 25600,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": _QWEN3
    | {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
}


def model_shape(path: str) -> dict[str, Any] | None:
    """The HF config of `model.path` as far as it is known on this machine (see the module docstring)."""
    from userrl_megatron.model_store import model_config

    config = model_config(path)
    if config is None:
        config = PUBLISHED_SHAPES.get(Path(path).name.lower())
    return config


def model_fit_problems(cfg: RootConfig) -> list[str]:
    """The model against the Megatron layout (heads, key/value heads and FFN over TP, layers over PP x VPP) and
    against the SGLang engines' TP (attention heads)."""
    config = model_shape(cfg.model.path)
    if config is None:
        return []
    try:
        arch = Architecture.from_hf_config(config)
    except UnsupportedModelError as e:
        return [f"model.path = {cfg.model.path}: {e}"]
    except (KeyError, TypeError, ValueError) as e:
        return [f"model.path = {cfg.model.path}: its config.json lacks or mangles {e}"]
    problems = model_layout_problems(cfg.megatron, arch) + moe_training_problems(cfg.megatron, arch)
    if cfg.algo.routing_replay != "none" and not arch.is_moe:
        problems.append(
            f"algo.routing_replay = {cfg.algo.routing_replay} needs a mixture-of-experts model; "
            f"{arch.family} is dense (set it to none)"
        )
    engine_tp = cfg.rollout.engine_tp
    if cfg.rollout.backend == "sglang" and engine_tp > 1 and arch.num_heads % engine_tp:
        problems.append(f"rollout.engine_tp = {engine_tp} must divide the model's {arch.num_heads} attention heads")
    where = f"model.path = {cfg.model.path}"
    if cfg.model.path == ModelConfig.path:
        where += ", the default; for another model put its configs/model/*.yaml first or set model.path"
    return [f"{p} ({where})" for p in problems] + _simulator_fit_problems(cfg)


def _simulator_fit_problems(cfg: RootConfig) -> list[str]:
    """The user simulator's served model (`user_sim.engines`) against its SGLang engines' TP."""
    engines = cfg.user_sim.engines
    config = model_shape(engines.model) if engines.model else None
    if config is None or (engines.backend or cfg.rollout.backend) != "sglang" or engines.engine_tp <= 1:
        return []
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % engines.engine_tp:
        return [
            f"user_sim.engines.engine_tp = {engines.engine_tp} must divide the simulator model's {heads} attention "
            f"heads (user_sim.engines.model = {engines.model})"
        ]
    return []
