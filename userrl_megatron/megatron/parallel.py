"""Process setup for the Megatron actor: torch.distributed, Megatron's model-parallel groups, CPU support.

`initialize(cfg, rank=..., world_size=..., master_addr=..., master_port=...)` is the one call every actor
rank makes first, whether it runs in a Ray actor, a `torch.multiprocessing` child or under `torchrun`. It
uses gloo on CPU (and installs the CPU support, see `cpu.py`) and NCCL on GPU, one rank per device
(`device_plan`: ranks that would share a GPU are refused with a ConfigError naming the fix), then builds Megatron's
TP / PP (virtual PP) / CP / DP groups in Megatron's default order (tp-cp-ep-dp-pp), and the MoE groups:
expert parallel (EP, carved out of the data-parallel ranks) and expert tensor parallel (ETP = TP, so the
experts of a rank are sharded over its own TP group).

Layout errors (sizes that do not divide the world, or the model) are raised as `ConfigError`s naming the
config keys, before any group is created.
"""

import datetime
import logging
import os
from dataclasses import dataclass

import torch

from userrl_megatron.config.layout import layout_problems, model_layout_problems, rank_device
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron import cpu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: sizes of each parallel dimension and this rank's index in each."""

    rank: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep: int = 1
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_stage_source(self) -> bool:
        """tp_rank 0, cp_rank 0, dp_rank 0 of its pipeline stage: the rank that yields exported weights."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0

    @property
    def is_output_rank(self) -> bool:
        """Last stage, tp_rank 0: reports the outputs (log-probs, loss sums) of its data-parallel replica;
        with context parallelism each CP rank reports its own positions."""
        return self.is_last_stage and self.tp_rank == 0


def check_layout(cfg: MegatronConfig, world_size: int) -> None:
    """Raise ConfigError if the parallel sizes in `cfg` cannot tile `world_size` ranks (rules: config/layout.py)."""
    problems = layout_problems(cfg, world_size, on_gpu=torch.cuda.is_available())
    if problems:
        raise ConfigError(problems)


def check_model_layout(cfg: MegatronConfig, arch: Architecture) -> None:
    """Raise ConfigError if the model cannot be split as `cfg` asks (heads over TP, layers over PP stages)."""
    problems = model_layout_problems(cfg, arch)
    if problems:
        raise ConfigError(problems)


def initialize(
    cfg: MegatronConfig,
    *,
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    timeout_minutes: int = 30,
    device_peers: tuple[int, int] | None = None,
) -> Layout:
    """Join the process group and build Megatron's parallel groups; returns this rank's Layout.

    Safe to call in Ray actors, spawned children and torchrun workers. On CPU it installs the CPU support.
    `device_peers`: (this process's index, their count) among the processes that see the same CUDA devices
    (a Ray actor sees its own GPU only: (0, 1)); None: LOCAL_RANK and LOCAL_WORLD_SIZE when both are set
    (torchrun), else (rank, world_size) (processes spawned on this machine). Calling it again lays the same
    processes out anew (the default process group is kept; actors built under the previous layout must not be
    used any more).
    """
    check_layout(cfg, world_size)
    device_index = device_plan(rank, world_size, torch.cuda.device_count(), device_peers)
    on_gpu = device_index is not None
    if not on_gpu:
        cpu.install()
    from megatron.core import parallel_state

    if device_index is not None:
        torch.cuda.set_device(device_index)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():  # a new layout on the same processes
        parallel_state.destroy_model_parallel()
    vpp = cfg.virtual_pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.tensor_model_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    layout = current_layout()
    log.info(
        "rank %d/%d: tp %d/%d pp %d/%d cp %d/%d dp %d/%d ep %d/%d (%s)",
        rank,
        world_size,
        layout.tp_rank,
        layout.tp,
        layout.pp_rank,
        layout.pp,
        layout.cp_rank,
        layout.cp,
        layout.dp_rank,
        layout.dp,
        layout.ep_rank,
        layout.ep,
        "nccl" if on_gpu else "gloo, CPU support installed",
    )
    return layout


def current_layout() -> Layout:
    """The Layout of this rank, read from Megatron's parallel state (after `initialize`)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    return Layout(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        vpp=vpp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def shutdown() -> None:
    """Destroy Megatron's groups and the default process group (end of a worker's life)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_plan(rank: int, world_size: int, visible: int, device_peers: tuple[int, int] | None = None) -> int | None:
    """The CUDA device index of `rank` among the `visible` devices its process sees (None: gloo on the CPU), for
    the `device_peers` of `initialize`; raises ConfigError when ranks would share a device (NCCL refuses it)."""
    if device_peers is None:
        local, local_world = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        device_peers = (int(local), int(local_world)) if local and local_world else (rank, world_size)
    return rank_device(visible, *device_peers)


def stage_group() -> tuple[object, list[int]]:
    """This rank's pipeline stage as a process group (tensor x context x data parallel) and its global ranks."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return group, torch.distributed.get_process_group_ranks(group)
