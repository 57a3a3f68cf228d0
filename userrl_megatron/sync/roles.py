"""Who takes part in weight sync (pure Python: no torch, so a dry bring-up can say it without CUDA): the engines
as a sender sees them, each engine's ranks in a broadcast group, and for tensor handles whose copy of a bucket
each engine TP rank maps."""

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class EngineEndpoint:
    """One engine as the sender sees it: its URL, how many ranks it adds to the group (its TP size), the
    device index of its first TP rank in the placement's order (None: not on the trainer's devices), the API
    key its calls carry ("" = none), the checkpoint directory it loaded ("" = unknown), whose tensor names are
    the ones it accepts, and its backend (`rollout.backend`): which payload format tensor handles travel in (the
    embedded engine's own, or SGLang's pickle; an embedded engine refuses pickles unless told otherwise)."""

    url: str
    tp_size: int = 1
    first_device: int | None = None
    api_key: str = field(default="", repr=False)
    checkpoint: str = ""
    backend: str = "sglang"


def group_world_size(engines: Sequence[EngineEndpoint]) -> int:
    """A broadcast group's size: rank 0 (the sender) plus every engine TP rank."""
    return 1 + sum(e.tp_size for e in engines)


def engine_offsets(engines: Sequence[EngineEndpoint]) -> list[int]:
    """Each engine's first rank in the broadcast group (its TP ranks follow)."""
    return [1 + sum(e.tp_size for e in engines[:i]) for i in range(len(engines))]


def payload_holders(engines: Sequence[EngineEndpoint], ranks: Sequence[int]) -> list[list[int]]:
    """For each engine TP rank, the global rank whose copy of the bucket it maps: the actor rank on its device
    when that rank is in `ranks` (the ranks packing their own copy, source first), else the source."""
    holders = []
    for engine in engines:
        row: list[int] = []
        for j in range(engine.tp_size):
            device = None if engine.first_device is None else engine.first_device + j
            row.append(device if device is not None and device in ranks else ranks[0])
        holders.append(row)
    return holders
