"""The engine's side of the per-tensor wire format (`server/weights.receive_weights`) over a real gloo group: a
tensor the destination gives memory for lands in it (the engine's own parameter, nothing to load), the others in
the reused buffer, in `names` order; and a layout it refuses is refused before anything is received. Rank 0 here,
the engine as rank 1 in a spawned child."""

import multiprocessing as mp
from typing import Any

import pytest
import torch
import torch.distributed as dist

from userrl_megatron.ports import free_port
from userrl_megatron.server.weights import receive_weights
from userrl_megatron.wire.bucket import FlatBuffer
from userrl_megatron.wire.group import destroy_custom_process_group, init_custom_process_group

pytestmark = pytest.mark.distributed

DEADLINE_S = 600.0  # a spawned process imports torch and joins: only a hang takes longer
NAMES, DTYPES, SHAPES = ["a", "b", "c"], ["float32", "bfloat16", "float64"], [[2, 3], [5], [4]]
SENT = [
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    torch.tensor([0.5, 1.5, -2.0, 3.0, 4.0], dtype=torch.bfloat16),
    torch.tensor([1e-3, 2.0, 3.0, -4.0], dtype=torch.float64),
]


def _engine(port: int, queue: Any) -> None:
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "receive")
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(5), "c": torch.zeros(4, dtype=torch.float64)}
    addresses = {name: tensor.data_ptr() for name, tensor in own.items()}

    def destination(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        tensor = own.get(name)  # "b" arrives in bf16: not its dtype, so it goes through the buffer
        return tensor if tensor is not None and (tensor.dtype, tuple(tensor.shape)) == (dtype, shape) else None

    buffer, cpu = FlatBuffer("cpu"), torch.device("cpu")
    report: dict[str, Any] = {}
    mixed = receive_weights(group, NAMES, DTYPES, SHAPES, None, cpu, buffer, destination)
    report["mixed"] = [(name, tensor.dtype, tensor.tolist()) for name, tensor in mixed]
    report["own"] = {name: tensor.tolist() for name, tensor in own.items()}
    report["in place"] = all(tensor.data_ptr() == addresses[name] for name, tensor in own.items())
    everything = receive_weights(
        group, ["a", "c"], ["float32", "float64"], [[2, 3], [4]], None, cpu, buffer, destination
    )
    report["all placed"] = (everything, own["a"].tolist(), own["c"].tolist())
    plain = receive_weights(group, NAMES, DTYPES, SHAPES, None, cpu, buffer)
    report["plain"] = [(name, tensor.dtype, tensor.tolist()) for name, tensor in plain]
    try:
        receive_weights(group, ["a", "b"], ["float32"], [[2, 3], [5]], None, cpu, buffer, destination)
    except ValueError as e:
        report["refused"] = str(e)
    queue.put(report)
    destroy_custom_process_group(group)


def test_tensors_land_in_their_destinations_and_the_rest_in_the_buffer() -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_engine, args=(port, queue))
    child.start()
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "receive")
    for tensors in (SENT, [SENT[0] * 2, SENT[2] * 2], SENT):
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)
    report = queue.get(timeout=DEADLINE_S)
    child.join(timeout=DEADLINE_S)
    destroy_custom_process_group(group)
    assert child.exitcode == 0
    assert report["mixed"] == [("b", torch.bfloat16, SENT[1].tolist())]  # only what had no destination
    assert report["own"] == {"a": SENT[0].tolist(), "b": [0.0] * 5, "c": SENT[2].tolist()}
    assert report["in place"]
    assert report["all placed"] == ([], (SENT[0] * 2).tolist(), (SENT[2] * 2).tolist())
    assert report["plain"] == [(n, t.dtype, t.tolist()) for n, t in zip(NAMES, SENT, strict=True)]
    assert report["refused"] == "names, dtypes and shapes differ in length: 2, 1, 2"
