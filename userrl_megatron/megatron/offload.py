"""Offload between phases: the actor's optimizer state, gradients and (optionally) weights leave the device and
their storage is really freed; onload brings them back in place. One code path on GPU and CPU.

Each tensor storage is copied into a region of host memory kept for the whole run (pinned when CUDA is there, so
the copies are asynchronous), then resized to zero bytes. The tensors themselves (parameters, DDP's buffers and
their views, Adam's moments, the fp32 master shards) stay the same Python objects, so nothing that holds them needs
to know. Gradients are not copied: onload gives back zeroed storage, as a new step expects. On CPU, "host" is the
same memory, but the freed storage is as gone as on a GPU: a step, save or export between offload and onload
meets empty tensors there too, and `Parking.require` turns that into a clear error first.

Host memory comes from a `HostArena`: chunks of `HOST_CHUNK_BYTES`, regions laid end to end across them. Pinned
memory goes through torch's caching host allocator, which rounds every block up to a power of two and keeps it
for the run (`ATen/core/CachingHostAllocator.h`); one pinned buffer per storage (Adam's moments and the master
shards are one storage per parameter) would cost up to twice the bytes. Chunks of a power-of-two size lose nothing
to that rounding: a rank's offload holds `arena_bytes(its bytes)`, at most one chunk more than it copies.
"""

from collections.abc import Iterable, Iterator

import torch

HOST_CHUNK_BYTES = 1 << 28  # 256 MiB: a power of two, which the caching host allocator takes as it is
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


def arena_bytes(nbytes: int, chunk_bytes: int = HOST_CHUNK_BYTES) -> int:
    """Host bytes an arena allocates to hold `nbytes`: whole chunks."""
    return -(-nbytes // chunk_bytes) * chunk_bytes


class HostArena:
    """Host memory handed out as regions laid end to end over chunks of `chunk_bytes` (allocated as needed, kept
    until the arena goes), pinned when `pinned`. A region is a list of uint8 pieces, one per chunk it touches."""

    def __init__(self, pinned: bool, chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
        self.pinned, self.chunk_bytes = pinned, chunk_bytes
        self.chunks: list[torch.Tensor] = []
        self.used = 0  # bytes handed out

    @property
    def nbytes(self) -> int:
        """Bytes allocated (whole chunks)."""
        return len(self.chunks) * self.chunk_bytes

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """A region of `nbytes` bytes after the last one (contents undefined)."""
        pieces = []
        while nbytes > 0:
            index, offset = divmod(self.used, self.chunk_bytes)
            if index == len(self.chunks):
                self.chunks.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned))
            n = min(nbytes, self.chunk_bytes - offset)
            pieces.append(self.chunks[index][offset : offset + n])
            self.used, nbytes = self.used + n, nbytes - n
        return pieces


def save_bytes(region: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the 1-D uint8 tensor `flat` into `region` (asynchronous from a device: synchronise before reading)."""
    start = 0
    for piece in region:
        piece.copy_(flat[start : start + piece.numel()], non_blocking=True)
        start += piece.numel()


def restore_bytes(flat: torch.Tensor, region: list[torch.Tensor]) -> None:
    """Copy `region` back into the 1-D uint8 tensor `flat` (asynchronous to a device)."""
    start = 0
    for piece in region:
        flat[start : start + piece.numel()].copy_(piece, non_blocking=True)
        start += piece.numel()


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of `storage` as a 1-D uint8 tensor sharing its memory."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view of it."""
    return tensor.detach().view(-1).view(torch.uint8)


class Parking:
    """The storages offloaded so far, by kind, and their regions of host memory."""

    def __init__(self, chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
        self.arena = HostArena(torch.cuda.is_available(), chunk_bytes)
        self.host: dict[int, list[torch.Tensor]] = {}  # storage key -> its region, reused at every offload
        self.parked: dict[int, tuple[str, torch.UntypedStorage, int]] = {}  # key -> (kind, storage, bytes)

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, _, _ in self.parked.values()}

    def require(self, what: str) -> None:
        """Raise if anything `what` reads (`NEEDS`) is offloaded: it would read freed storage."""
        away = sorted(set(NEEDS[what]) & self.kinds)
        if away:
            raise RuntimeError(f"{what}: the actor's {', '.join(away)} are offloaded; onload first")

    @torch.no_grad()
    def offload(self, storages: dict[str, list[torch.UntypedStorage]]) -> None:
        """Copy the storages of each kind to host (not the grads), then free them on the device."""
        todo = []
        for kind, group in storages.items():
            for storage in group:
                key = storage._cdata
                if key in self.parked or storage.nbytes() == 0:
                    continue
                if kind != GRADS:
                    region = self.host.get(key)
                    if region is None or sum(p.numel() for p in region) != storage.nbytes():
                        region = self.host[key] = self.arena.take(storage.nbytes())
                    save_bytes(region, storage_bytes(storage))
                todo.append((key, kind, storage))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the device memory goes
        for key, kind, storage in todo:
            self.parked[key] = (kind, storage, storage.nbytes())
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @torch.no_grad()
    def onload(self, kinds: Iterable[str] = (WEIGHTS, STATE, GRADS)) -> None:
        """Give the parked storages of `kinds` their bytes back: copied from host, or zeroed for grads."""
        for key, (kind, storage, nbytes) in list(self.parked.items()):
            if kind not in kinds:
                continue
            storage.resize_(nbytes)
            if kind == GRADS:
                storage_bytes(storage).zero_()
            else:
                restore_bytes(storage_bytes(storage), self.host[key])
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
