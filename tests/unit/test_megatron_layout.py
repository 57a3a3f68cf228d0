"""Parallel-layout validation: clear errors, naming the config keys, before any process group exists."""

import dataclasses

import pytest

from tests.support.tiny_models import tiny_config
from userrl_megatron.config import ConfigError, MegatronConfig, load_config
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.parallel import Layout, check_layout, check_model_layout

ARCH = Architecture.from_hf_config(tiny_config("qwen2", num_hidden_layers=6).to_dict())  # 4 heads, 2 KV heads


def cfg(**changes: int | bool) -> MegatronConfig:
    return dataclasses.replace(MegatronConfig(), **changes)


def test_valid_layouts_pass() -> None:
    check_layout(cfg(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), world_size=8)
    check_model_layout(cfg(tensor_model_parallel_size=2, pipeline_model_parallel_size=3), ARCH)
    check_layout(cfg(pipeline_model_parallel_size=3, virtual_pipeline_model_parallel_size=2), world_size=3)


def test_sizes_that_do_not_tile_the_world() -> None:
    with pytest.raises(ConfigError, match=r"2 x 2 x 1 = 4 does not divide the actor device count .* = 6"):
        check_layout(cfg(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), world_size=6)


def test_interleaving_needs_three_stages() -> None:
    with pytest.raises(
        ConfigError, match="virtual_pipeline_model_parallel_size = 2 needs pipeline_model_parallel_size >= 3, got 2"
    ):
        check_layout(cfg(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), world_size=2)


def test_gpu_only_features_are_refused_on_cpu() -> None:
    with pytest.raises(ConfigError) as err:
        check_layout(cfg(context_parallel_size=2, sequence_parallel=True, tensor_model_parallel_size=2), world_size=4)
    assert "context_parallel_size > 1 needs CUDA" in str(err.value)
    assert "sequence_parallel needs CUDA" in str(err.value)


def test_model_must_split_over_the_layout() -> None:
    with pytest.raises(ConfigError) as err:
        check_model_layout(cfg(tensor_model_parallel_size=4, pipeline_model_parallel_size=4), ARCH)
    message = str(err.value)
    assert "tensor_model_parallel_size = 4 must divide the model's 2 key/value heads (num_key_value_heads)" in message
    assert (
        "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = 4 x 1 must divide the model's 6 layers"
        in message
    )
    assert "attention heads" not in message  # 4 heads do split over TP 4


def test_layout_roles() -> None:
    last = Layout(rank=5, world_size=8, tp=2, pp=2, cp=1, dp=2, vpp=1, tp_rank=0, pp_rank=1, cp_rank=0, dp_rank=1)
    assert last.is_last_stage and last.is_output_rank and not last.is_stage_source
    source = dataclasses.replace(last, dp_rank=0, pp_rank=0)
    assert source.is_stage_source and source.is_first_stage and not source.is_output_rank


def test_decaying_schedules_need_decay_steps() -> None:
    with pytest.raises(
        ConfigError,
        match=r"megatron.lr_schedule = cosine needs megatron.lr_decay_steps > megatron.lr_warmup_steps, got 10 <= 10",
    ):
        load_config([], ["megatron.lr_schedule=cosine", "megatron.lr_warmup_steps=10", "megatron.lr_decay_steps=10"])
    assert (
        load_config([], ["megatron.lr_schedule=cosine", "megatron.lr_decay_steps=100"]).megatron.lr_decay_steps == 100
    )


MOE = Architecture.from_hf_config(tiny_config("qwen3_moe").to_dict())  # 8 experts of width 32


def test_expert_parallel_layouts() -> None:
    check_layout(cfg(expert_model_parallel_size=4, tensor_model_parallel_size=2), world_size=8)  # dp 4
    check_model_layout(cfg(expert_model_parallel_size=8), MOE)
    with pytest.raises(ConfigError, match="expert_model_parallel_size = 4 must divide the data-parallel size 2"):
        check_layout(cfg(expert_model_parallel_size=4, tensor_model_parallel_size=2), world_size=4)
    with pytest.raises(ConfigError) as err:
        check_model_layout(cfg(expert_model_parallel_size=3, tensor_model_parallel_size=64), MOE)
    message = str(err.value)
    assert "expert_model_parallel_size = 3 must divide the model's 8 experts (num_experts)" in message
    assert "tensor_model_parallel_size = 64 must divide the model's moe_intermediate_size 32" in message
    assert "intermediate_size 128" not in message  # the dense width of a MoE model is not used
    with pytest.raises(ConfigError, match="expert_model_parallel_size = 2 needs a mixture-of-experts model; qwen2"):
        check_model_layout(cfg(expert_model_parallel_size=2), ARCH)


def test_moe_training_under_tp_needs_sequence_parallelism() -> None:
    from userrl_megatron.config.layout import moe_training_problems

    assert moe_training_problems(cfg(tensor_model_parallel_size=2, sequence_parallel=True), MOE) == []
    assert moe_training_problems(cfg(tensor_model_parallel_size=2), ARCH) == []
    (problem,) = moe_training_problems(cfg(tensor_model_parallel_size=2), MOE)
    assert "mixture-of-experts model needs megatron.sequence_parallel = true" in problem
