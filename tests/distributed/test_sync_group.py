"""init_custom_process_group: rank 0 hosts the store, other ranks join by group name; broadcasts then work
without a default process group. Runs rank 1 and 2 in child processes (spawn), rank 0 here."""

import multiprocessing as mp
import socket

import pytest
import torch
import torch.distributed as dist

from userrl_megatron.wire.bucket import pack_bucket
from userrl_megatron.wire.group import destroy_custom_process_group, init_custom_process_group

pytestmark = pytest.mark.distributed

DEADLINE_S = 600.0  # two spawned processes import torch and join: only a hang takes longer


def _engine_rank(rank: int, port: int, queue: mp.Queue) -> None:
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 3, rank, "weights")
    per_tensor = torch.empty(2, 3)
    dist.broadcast(per_tensor, src=0, group=group)
    flat = torch.empty(24 + 4, dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=group)
    queue.put((rank, per_tensor.tolist(), flat.tolist()))
    destroy_custom_process_group(group)


def test_trainer_broadcasts_to_two_engine_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_engine_rank, args=(rank, port, queue)) for rank in (1, 2)]
    for child in children:
        child.start()
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 3, 0, "weights")
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    dist.broadcast(weight, src=0, group=group)
    flat, _ = pack_bucket([("a", weight), ("b", torch.tensor([0.5], dtype=torch.float32))])
    dist.broadcast(flat, src=0, group=group)
    results = sorted(queue.get(timeout=DEADLINE_S) for _ in children)
    for child in children:
        child.join(timeout=DEADLINE_S)
        assert child.exitcode == 0
    destroy_custom_process_group(group)
    assert [r[0] for r in results] == [1, 2]
    for _, received, bucket in results:
        assert received == weight.tolist()
        assert bucket == flat.tolist()


def test_bad_rank_and_name_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^rank 3 is outside the group of world_size 2$"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", 2, 3, "g")
    with pytest.raises(ValueError, match=r"^group_name must not be empty$"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", 2, 0, "")
