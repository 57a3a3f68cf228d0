"""The sender side of colocated weight sync: buckets handed to the engines as handles (SGLang's
`update_weights_from_tensor`), for engines that share the trainer's devices.

A colocated run cannot use the broadcast of `sender.WeightSender`: NCCL refuses a group in which two ranks use one
GPU. Here the source rank of a pipeline stage packs its HF-named tensors into buckets of `sync.bucket_mb` exactly
as the broadcast path does (SGLang's `flattened_bucket` layout), but each bucket lives in memory another process
can map (`handles.py`: CUDA IPC on GPU, a named shared-memory file on CPU), and every engine gets one small
payload per TP rank naming that memory. The engine copies the tensors into its weights and answers; only then is
the bucket's memory dropped (on CPU the shared-memory file disappears with it). One bucket is in flight while the
next is packed.

Defences (what real SGLang 0.5.23 does on this path, docs/engine.md):
- an unknown tensor name is accepted and ignored: every name is looked up on every engine before the first push;
- a tensor of the wrong shape kills the SGLang server (an assertion in its scheduler): the push fails naming the
  engine (`WeightUpdateRefusedError`), which the pool then restarts;
- a refusal (no session, a dead engine) fails the push naming the engines, as on the broadcast path.
"""

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from userrl_megatron.config.schema import SyncConfig
from userrl_megatron.sync.bucket import BucketEntry
from userrl_megatron.sync.handles import flattened_bucket, serialize
from userrl_megatron.sync.sender import (
    REFUSAL_GRACE_S,
    EngineEndpoint,
    WeightSender,
    _Clock,
    _InFlight,
    _Packer,
)

log = logging.getLogger(__name__)


class SharedBuffer:
    """Hands out a fresh bucket of memory another process can map: a named shared-memory file on CPU, device
    memory (shared through CUDA IPC when pickled) on GPU. The caller drops it once the engines answered."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def take(self, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor of `nbytes` bytes (contents undefined)."""
        if self.device.type == "cpu":
            storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class TensorSender(WeightSender):
    """Pushes weights to engines on this node through tensor handles; same interface as `WeightSender`."""

    def __init__(
        self,
        cfg: SyncConfig,
        engines: list[EngineEndpoint],
        group_name: str = "userrl_weight_sync",
        device: torch.device | str = "cpu",
        client_factory: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__(cfg, engines, group_name, "gloo", client_factory)
        self.device = torch.device(device)
        self._shared = SharedBuffer(self.device)
        # Bytes of each bucket of the last push: every sync exports the same tensors, so later buckets take exactly
        # what they need (a fresh shared-memory file costs time in proportion to its size).
        self._sizes: list[int] = []
        self._pushing: list[int] = []

    def connect(self, master_address: str = "", master_port: int = 0) -> None:
        """Nothing to set up: handles need no process group (the arguments keep `WeightSender`'s interface)."""
        self._connected = True
        log.info(
            "weight sync %s: %d engines through tensor handles on %s", self.group_name, len(self.engines), self.device
        )

    def _new_packer(self, index: int) -> _Packer:
        if index == 0 and self._pushing:  # a new push: the last one's sizes are complete
            self._sizes, self._pushing = self._pushing, []
        capacity = self._sizes[index] if index < len(self._sizes) else None
        return _Packer(self._shared, capacity)  # type: ignore[arg-type]

    def _send(self, packer: _Packer, version: int, previous: _InFlight | None, clock: _Clock) -> _InFlight:
        """Once the previous bucket has landed, post this one's handles to every engine (one payload per TP rank)."""
        self._wait(previous, clock)
        self._pushing.append(packer.nbytes)
        names = [e[0] for e in packer.entries]
        with clock("serialize"):
            bucket = flattened_bucket(packer.flat(), bucket_entries(packer.entries))
            payloads = [[serialize(bucket) for _ in range(engine.tp_size)] for engine in self.engines]
        replies = [
            self._loop.submit(
                client.update_weights_from_tensor(
                    payload, load_format="flattened_bucket", flush_cache=False, weight_version=str(version)
                )
            )
            for client, payload in zip(self._clients, payloads, strict=True)
        ]
        return _InFlight(None, replies, names, packer)

    def _wait(self, inflight: _InFlight | None, clock: _Clock) -> None:
        """Wait for every engine's answer, then free the bucket; raise at the first refusal."""
        if inflight is None:
            return
        try:
            with clock("engine_load"):
                wait_futures(inflight.replies, return_when=FIRST_EXCEPTION)
                self._raise_refusals(inflight, REFUSAL_GRACE_S)
        finally:
            if inflight.packer is not None:
                inflight.packer.release()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # the engines closed their handles: the memory can really go

    def close(self) -> None:
        """Stop the HTTP thread (there is no group to leave)."""
        self._connected = False
        super().close()


def bucket_entries(entries: Sequence[tuple[str, torch.dtype, list[int], int, int]]) -> list[BucketEntry]:
    """A packer's (name, dtype, shape, start, end) rows as `BucketEntry`s."""
    return [BucketEntry(name, dtype, tuple(shape), start, end) for name, dtype, shape, start, end in entries]
