"""The reference policy for the KL term: the initial weights, kept in host memory and swapped into the actor's
parameters for a reference log-prob pass, then swapped back.

Both host copies (the reference, and the trained weights while they step out) are regions of a `HostArena`
(`offload.py`: chunks of a power of two, pinned when CUDA is there, allocated once for the run), and every copy is
non-blocking with one synchronisation per direction: a swap costs two host<->device transfers of the weights and
no allocation.
"""

import contextlib
from collections.abc import Iterator

import torch

from userrl_megatron.megatron.offload import HostArena, restore_bytes, save_bytes, tensor_bytes


class ReferenceWeights:
    """A host copy of `parameters` as they are now, and room to park them while the copy is swapped in."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        pinned = torch.cuda.is_available()
        self.reference, self.parked = HostArena(pinned), HostArena(pinned)
        self._reference = [self.reference.take(_nbytes(p)) for p in parameters]
        self._parked = [self.parked.take(_nbytes(p)) for p in parameters]
        _save(self._reference, parameters)

    @contextlib.contextmanager
    def swapped_in(self, parameters: list[torch.nn.Parameter]) -> Iterator[None]:
        """Run the body with the reference weights in `parameters`; the trained weights come back after it."""
        _save(self._parked, parameters)
        _restore(parameters, self._reference)
        try:
            yield
        finally:
            _restore(parameters, self._parked)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


@torch.no_grad()
def _save(regions: list[list[torch.Tensor]], parameters: list[torch.nn.Parameter]) -> None:
    for region, p in zip(regions, parameters, strict=True):
        save_bytes(region, tensor_bytes(p))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def _restore(parameters: list[torch.nn.Parameter], regions: list[list[torch.Tensor]]) -> None:
    for p, region in zip(parameters, regions, strict=True):
        restore_bytes(tensor_bytes(p), region)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
