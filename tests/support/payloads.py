"""Weight-update payloads as a client that never imported megatron.core writes them."""

import pickle


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
