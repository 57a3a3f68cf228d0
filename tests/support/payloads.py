"""Weight-update payloads: tensors packed into a shared-memory bucket as the tensor-handle sender packs them, and
pickles as a client that never imported megatron.core writes them."""

import pickle

import torch

from userrl_megatron.sync.sender import _Packer
from userrl_megatron.sync.tensor_sender import SharedBuffer


def packed(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 20) -> _Packer:
    """`named` packed back to back into a bucket of a fresh CPU shared-memory segment (`packer.buffer.release()`
    gives it back)."""
    packer = _Packer(SharedBuffer("cpu"))  # type: ignore[arg-type]
    for name, tensor in named:
        packer.add(name, tensor, bucket_bytes)
    return packer


def plain_pickle(obj: object) -> bytes:
    """`pickle.dumps` as a process that never imported megatron.core writes it. Importing megatron.core (other
    tests of this process may have) replaces `torch.storage._load_from_bytes` with its own function, and plain
    pickles of tensors then name `megatron.core.safe_globals`, which SGLang's unpickler (and ours) refuses."""
    import torch.storage

    def _load_from_bytes(b: bytes) -> object:  # never called: only its name is pickled
        raise AssertionError

    _load_from_bytes.__module__, _load_from_bytes.__qualname__ = "torch.storage", "_load_from_bytes"
    current = torch.storage._load_from_bytes
    torch.storage._load_from_bytes = _load_from_bytes
    try:
        return pickle.dumps(obj)
    finally:
        torch.storage._load_from_bytes = current
