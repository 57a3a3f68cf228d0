"""Megatron DDP wrapping, the (distributed) AdamW optimizer and the LR schedule (offload: `offload.py`).

Gradients are reduced in fp32 across data-parallel ranks; with `megatron.use_distributed_optimizer` the
optimizer state is sharded across them (ZeRO-1). The LR schedule is Megatron's `OptimizerParamScheduler`:
linear warmup from 0 over `lr_warmup_steps`, then constant, linear or cosine decay to `min_lr` over
`lr_decay_steps`. The schedule is advanced *before* each optimizer step, so the k-th step (1-based) uses
the learning rate of step k (a warmup of one step trains at the full rate from the first step).
"""

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, param_and_grad_buffer
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from userrl_megatron.config.schema import MegatronConfig

log = logging.getLogger(__name__)


def wrap_ddp(chunks: list[torch.nn.Module], cfg: MegatronConfig) -> list[DistributedDataParallel]:
    """Wrap each model chunk in Megatron's DDP (contiguous fp32 gradient buffers)."""
    skip_collectives_of_one()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.overlap_grad_reduce,  # buckets reduced while the backward goes on, or all at the end
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    expert_dp_size = parallel_state.get_expert_data_parallel_world_size()  # MoE experts: DP x CP / EP
    wrapped = []
    for i, chunk in enumerate(chunks):
        layout = None
        if cfg.use_distributed_optimizer:  # the shard layout the optimizer expects, computed up front
            params = [p for p in chunk.parameters() if p.requires_grad]
            layout = DistributedOptimizer.compute_full_param_layout(params, None, dp_size, ddp_config, expert_dp_size)
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=i > 0,
                full_param_layout=layout,
            )
        )
    return wrapped


def build_optimizer(
    chunks: list[DistributedDataParallel], cfg: MegatronConfig, dtype: torch.dtype
) -> MegatronOptimizer:
    """AdamW with decoupled weight decay and global-norm clipping; fp32 master weights for bf16/fp16."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer: MegatronOptimizer) -> None:
    """Step CPU parameters with torch's fused AdamW kernel. Without Transformer Engine or apex (CPU), Megatron
    falls back to torch's AdamW, which on CPU defaults to its per-tensor loop: about ten element-wise passes
    over each tensor per step, several times slower than the fused kernel doing the same update in one."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Adam):  # torch's AdamW included; TE's / apex's are not
            continue
        for group in torch_optimizer.param_groups:
            if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in group["params"]):
                group["fused"], group["foreach"] = True, False


def build_scheduler(optimizer: MegatronOptimizer, cfg: MegatronConfig) -> OptimizerParamScheduler:
    """Megatron's LR scheduler for `megatron.lr_schedule` with warmup."""
    warmup = cfg.lr_warmup_steps
    decay = cfg.lr_decay_steps if cfg.lr_schedule != "constant" else warmup + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def current_lr(optimizer: MegatronOptimizer) -> float:
    """The learning rate of the first parameter group (all groups share the schedule)."""
    return float(optimizer.param_groups[0]["lr"])


def skip_collectives_of_one() -> None:
    """Make the distributed optimizer's parameter all-gather and gradient reduce-scatter free over a group of one.

    Megatron calls both over its data-parallel group whatever its size; with one rank the shard is the whole
    buffer, so both are the identity, yet gloo still copies every byte through a staging buffer (SmolLM2-135M's
    540 MB: a train step of 4.7 s became 3.9 s without them on CPU). Installed once per process (a renamed Megatron
    global fails here, loudly); groups of two or more call through."""
    module: Any = param_and_grad_buffer
    for attr in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        collective = getattr(module, attr)
        if not getattr(collective, "skips_groups_of_one", False):
            setattr(module, attr, alone_is_identity(collective))


def alone_is_identity(collective: Callable[..., Any]) -> Callable[..., Any]:
    """`collective(output, input, group=...)` (all-gather or reduce-scatter into a tensor), except over a group
    of one rank: `output` becomes `input` (nothing to do when they share memory) and no work handle is returned,
    which Megatron's coalescing manager accepts."""

    @functools.wraps(collective)
    def run(output: torch.Tensor, input: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        size = group.size() if group is not None else torch.distributed.get_world_size()
        if size != 1:
            return collective(output, input, *args, group=group, **kwargs)
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
        return None

    run.skips_groups_of_one = True  # type: ignore[attr-defined]
    return run
