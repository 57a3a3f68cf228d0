"""The reference policy for the KL term: the initial weights, kept in host memory and swapped into the actor's
parameters for a reference log-prob pass, then swapped back.

Both host copies (the reference, and the trained weights while they step out) are allocated once for the run,
pinned when CUDA is there, and every copy is non-blocking with one synchronisation per direction: a swap costs
two host<->device transfers of the weights and no allocation.
"""

import contextlib
from collections.abc import Iterator

import torch


class ReferenceWeights:
    """A host copy of `parameters` as they are now, and room to park them while the copy is swapped in."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.reference = [_host_buffer(p) for p in parameters]
        self.parked = [_host_buffer(p) for p in parameters]
        _copy(self.reference, parameters)

    @contextlib.contextmanager
    def swapped_in(self, parameters: list[torch.nn.Parameter]) -> Iterator[None]:
        """Run the body with the reference weights in `parameters`; the trained weights come back after it."""
        _copy(self.parked, parameters)
        _copy(parameters, self.reference)
        try:
            yield
        finally:
            _copy(parameters, self.parked)


def _host_buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")


@torch.no_grad()
def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
