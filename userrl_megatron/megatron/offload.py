"""Offload between phases: the actor's optimizer state, gradients and (optionally) weights leave the device and
their storage is really freed; onload brings them back in place. One code path on GPU and CPU.

Each tensor storage is copied into a host buffer kept for the whole run (pinned when CUDA is there, so the copies
are asynchronous), then resized to zero bytes. The tensors themselves (parameters, DDP's buffers and their
views, Adam's moments, the fp32 master shards) stay the same Python objects, so nothing that holds them needs
to know. Gradients are not copied: onload gives back zeroed storage, as a new step expects. On CPU, "host" is the
same memory, but the freed storage is as gone as on a GPU: a step, save or export between offload and onload
meets empty tensors there too, and `Parking.require` turns that into a clear error first.
"""

from collections.abc import Iterable, Iterator

import torch

WEIGHTS, STATE, GRADS = "weights", "optimizer state", "grads"
# What each operation on the actor reads, so none of it may be offloaded: the actor checks before it runs
# (`Parking.require`), the memory planner before it books (`plan/ledger.py`).
NEEDS: dict[str, tuple[str, ...]] = {
    "a log-prob pass": (WEIGHTS,),
    "a training step": (WEIGHTS, STATE, GRADS),
    "a weight export": (WEIGHTS,),
    "an HF export": (WEIGHTS,),
    "a checkpoint save": (WEIGHTS, STATE),
    "a model-only checkpoint save": (WEIGHTS,),
    "a checkpoint load": (WEIGHTS, STATE, GRADS),
    "the reference-weights swap": (WEIGHTS,),
}


class Parking:
    """The storages offloaded so far, by kind, and their host copies."""

    def __init__(self) -> None:
        self.host: dict[int, torch.UntypedStorage] = {}  # storage key -> host copy, reused at every offload
        self.parked: dict[int, tuple[str, torch.UntypedStorage, int]] = {}  # key -> (kind, storage, bytes)

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, _, _ in self.parked.values()}

    def require(self, what: str) -> None:
        """Raise if anything `what` reads (`NEEDS`) is offloaded: it would read freed storage."""
        away = sorted(set(NEEDS[what]) & self.kinds)
        if away:
            raise RuntimeError(f"{what}: the actor's {', '.join(away)} are offloaded; onload first")

    def offload(self, storages: dict[str, list[torch.UntypedStorage]]) -> None:
        """Copy the storages of each kind to host (not the grads), then free them on the device."""
        todo = []
        for kind, group in storages.items():
            for storage in group:
                key = storage._cdata
                if key in self.parked or storage.nbytes() == 0:
                    continue
                if kind != GRADS:
                    host = self.host.get(key)
                    if host is None or host.nbytes() != storage.nbytes():
                        pinned = torch.cuda.is_available() and storage.device.type == "cuda"
                        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
                        self.host[key] = host
                    host.copy_(storage, non_blocking=True)
                todo.append((key, kind, storage))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the device memory goes
        for key, kind, storage in todo:
            self.parked[key] = (kind, storage, storage.nbytes())
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self, kinds: Iterable[str] = (WEIGHTS, STATE, GRADS)) -> None:
        """Give the parked storages of `kinds` their bytes back: copied from host, or zeroed for grads."""
        for key, (kind, storage, nbytes) in list(self.parked.items()):
            if kind not in kinds:
                continue
            storage.resize_(nbytes)
            if kind == GRADS:
                storage.fill_(0)
            else:
                storage.copy_(self.host[key], non_blocking=True)
            del self.parked[key]
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def actor_storages(
    chunks: list[torch.nn.Module], optimizer: object, weights: bool
) -> dict[str, list[torch.UntypedStorage]]:
    """The storages of the actor's state by kind. A storage shared by several kinds (fp32 models: the master
    shards are views of the parameters) belongs to the weights, so offloading the optimizer state alone keeps it."""
    model = _unique(p.untyped_storage() for chunk in chunks for p in chunk.parameters())
    model_keys = {s._cdata for s in model}
    grads = _unique(
        b.grad_data.untyped_storage()
        for chunk in chunks
        for b in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", [])
        if b.grad_data is not None
    )
    state = [s for s in _unique(_optimizer_tensors(optimizer)) if s._cdata not in model_keys]
    out = {STATE: state, GRADS: grads}
    if weights:
        out[WEIGHTS] = model
    return out


def _optimizer_tensors(optimizer: object) -> Iterator[torch.UntypedStorage]:
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            yield from (p.untyped_storage() for p in group["params"])
        for state in torch_optimizer.state.values():
            yield from (v.untyped_storage() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _unique(storages: Iterable[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for storage in storages:
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())
