"""The export's tensor-parallel gather (`megatron/export._Gather.shards`) over a real gloo group of two spawned
ranks: rank 0 gets every rank's tensors in rank order, its own as they are (no copy) and the other rank's in one
buffer reused from batch to batch; the other rank sends each tensor from its own memory (it packs nothing), a
strided one included; with `everywhere`, every rank gets all of them."""

from typing import Any

import pytest
import torch
import torch.distributed as dist

from userrl_megatron.megatron.launch import run_local

pytestmark = pytest.mark.distributed


def _tensors(rank: int, scale: float) -> list[torch.Tensor]:
    """A (3, 4) matrix and a strided (5,) view: rank-specific values."""
    base = torch.arange(10, dtype=torch.float32) * scale + 100 * rank
    return [torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale + 100 * rank, base[::2]]


def _rank(rank: int, world_size: int, port: int) -> dict[str, Any]:
    from userrl_megatron.megatron.export import _Gather

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank)
    group = dist.new_group([0, 1])
    report: dict[str, Any] = {}
    gather = _Gather(group, 2, everywhere=False)
    first = _tensors(rank, 1.0)
    got = gather.shards(first)
    report["first"] = None if got is None else [[t.tolist() for t in mine] for mine in got]
    report["own kept"] = got is not None and all(a is b for a, b in zip(got[0], first, strict=True))
    recv_at = gather._buffers["recv"].data_ptr()
    got = gather.shards(_tensors(rank, 2.0)[:1])  # a smaller batch: the same buffer
    report["second"] = None if got is None else [[t.tolist() for t in mine] for mine in got]
    report["buffer reused"] = gather._buffers["recv"].data_ptr() == recv_at
    report["packed bytes"] = gather._buffers["send"].numel()
    everywhere = _Gather(group, 2, everywhere=True).shards(_tensors(rank, 3.0))
    report["everywhere"] = None if everywhere is None else [[t.tolist() for t in mine] for mine in everywhere]
    dist.destroy_process_group()
    return report


def test_rank_zero_gets_every_shard_and_the_other_rank_packs_nothing() -> None:
    zero, one = run_local(_rank, 2)

    def expected(scale: float, count: int = 2) -> list[list[Any]]:
        return [[t.tolist() for t in _tensors(r, scale)[:count]] for r in (0, 1)]

    assert zero["first"] == expected(1.0) and zero["own kept"]
    assert zero["second"] == expected(2.0, 1) and zero["buffer reused"]
    assert one["first"] is None and one["second"] is None
    assert one["packed bytes"] == 0  # every tensor went on the wire from its own memory
    assert zero["everywhere"] == one["everywhere"] == expected(3.0)
