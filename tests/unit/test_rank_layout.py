"""Where an actor rank sits without starting it: its parallel ranks as Megatron lays them out, and the one CUDA
device it may take (issue 27, item 4: every rank went on cuda:0 under NCCL, which refuses two ranks on a GPU)."""

import pytest

from userrl_megatron.config.layout import rank_coordinates, rank_device, stage_ranks, tensor_parallel_ranks
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.megatron.parallel import device_plan

SHARED = (
    "2 actor ranks would share the 1 CUDA device(s) their processes see, and NCCL needs one device per rank: give "
    "each rank its own GPU (CUDA_VISIBLE_DEVICES, or LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them), or "
    "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on the CPU with gloo"
)


def test_one_rank_per_device_or_a_clear_refusal() -> None:
    assert rank_device(visible=0, index=1, sharing=2) is None  # no CUDA: gloo on the CPU
    assert rank_device(visible=1, index=0, sharing=1) == 0  # a Ray actor sees its own GPU
    assert rank_device(visible=8, index=5, sharing=8) == 5  # torchrun: LOCAL_RANK of LOCAL_WORLD_SIZE
    with pytest.raises(ConfigError) as failure:
        rank_device(visible=1, index=1, sharing=2)  # two spawned ranks on a one-GPU machine
    assert failure.value.problems == [SHARED]


def test_initialize_picks_the_device_from_torchrun_or_from_the_spawned_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert device_plan(rank=3, world_size=8, visible=8) == 3  # spawned on this machine: rank r on device r
    assert device_plan(rank=1, world_size=2, visible=0) is None
    with pytest.raises(ConfigError) as failure:
        device_plan(rank=1, world_size=2, visible=1)
    assert failure.value.problems == [SHARED]
    assert device_plan(rank=9, world_size=16, visible=1, device_peers=(0, 1)) == 0  # Ray: its own GPU
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert device_plan(rank=9, world_size=16, visible=8) == 1


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "ep", "world"),
    [(2, 1, 1, 1, 8), (2, 1, 1, 4, 8), (1, 1, 1, 8, 8), (8, 1, 1, 1, 32), (2, 2, 1, 2, 8), (2, 1, 2, 2, 8)],
)
def test_rank_coordinates_are_megatrons(tp: int, pp: int, cp: int, ep: int, world: int) -> None:
    """The pure layout (what a dry actor rank reports) against Megatron's own rank generators."""
    from megatron.core.parallel_state import RankGenerator  # importable: tests/conftest.py stubbed triton's module

    cfg = MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    dp = world // (tp * pp * cp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")

    def index(groups: list[list[int]], rank: int) -> int:
        return next(g.index(rank) for g in groups if rank in g)

    def group(groups: list[list[int]], rank: int) -> list[int]:
        return next(g for g in groups if rank in g)

    for rank in range(world):
        got = rank_coordinates(cfg, rank, world)
        assert got == {
            "tp_rank": index(dense.get_ranks("tp"), rank),
            "cp_rank": index(dense.get_ranks("cp"), rank),
            "dp_rank": index(dense.get_ranks("dp"), rank),
            "pp_rank": index(dense.get_ranks("pp"), rank),
            "ep_rank": index(experts.get_ranks("ep"), rank),
            "tp": tp,
            "cp": cp,
            "dp": dp,
            "pp": pp,
            "ep": ep,
        }
        assert tensor_parallel_ranks(cfg, rank) == group(dense.get_ranks("tp"), rank)
        assert stage_ranks(cfg, rank, world) == group(dense.get_ranks("tp-cp-dp"), rank)
