"""The embedded engine's float32 linear layers on CPU through oneDNN's matmul instead of torch's default.

torch runs a float32 `linear` on CPU as a BLAS sgemm (MKL in the x86 wheels); at the row counts of decoding (one
to a few hundred rows against each weight matrix) oneDNN's matmul, the kernel torch already uses for bfloat16 on
CPU, is faster: on the project's 2-core machine SmolLM2-135M generated 1.3-1.4x the tokens/s (docs/benchmarks.md).
The weights stay the module's own parameters, unpacked: a weight update written into a parameter is what the next
forward reads, and read-back is unchanged. The results differ from torch's only in the order of the sums (about
1e-5 relative in float32).
"""

import functools
import platform

import torch


def available() -> bool:
    """Whether this torch build has oneDNN's linear operator on this CPU (x86 builds; measured only there)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for a 2-D float32 `x` on CPU, by oneDNN's matmul (without autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.numel() == 0 or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, module.weight, module.bias)
    out = linear(x.reshape(-1, x.shape[-1]), module.weight, module.bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def route_linears(model: torch.nn.Module) -> None:
    """Send every float32 `nn.Linear` of `model` (on CPU) through oneDNN; other inputs still take torch's own
    `linear`."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            module.forward = functools.partial(_forward, module)  # type: ignore[method-assign]
