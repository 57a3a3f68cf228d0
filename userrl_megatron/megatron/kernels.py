"""Plain-torch stand-ins for the fused kernels Megatron takes from Transformer Engine or apex, where neither is
installed (CPU; a GPU without them), faster than Megatron's own fallbacks and bit-identical to them.

* **RoPE.** Megatron's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`) builds `rotate_half(t)` with a
  `cat`, multiplies and adds full-width tensors, then `cat`s the result with the (usually empty) unrotated tail:
  three full copies of q and of k in every layer, and autograd keeps `t` and the rotated copy for the backward.
  `apply_rope` writes each half of the output in place and keeps only cos and sin; its backward is the same
  rotation transposed. Each output element is rounded in the same order as Megatron's (`a*cos`, `b*sin`, then
  the sum). Megatron calls it as its fused RoPE (`rope_utils.fused_apply_rotary_pos_emb`, TE's signature) when
  `apply_rope_fusion` is on, which `model.transformer_fields` always asks for.
* **Multi-tensor scale.** Megatron's fallback for apex's `multi_tensor_scale`, which gradient clipping calls
  with the same list as source and destination, computes `src * scale` into a new tensor and copies it back:
  two passes over every gradient and an allocation each. `multi_tensor_scale` scales such lists in place.

`provide()` installs both (idempotent); kernels that TE or apex provide are left in place.
"""

import torch
from megatron.core import utils as megatron_utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer


def _halves(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves RoPE rotates into each other: [first | second] or [even | odd] positions."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, transpose: bool
) -> None:
    """out = x*cos + rotate_half(x)*sin, rotate_half([a | b]) = [-b | a], written half by half; or, with
    `transpose`, the transposed map (the backward): [a*cos_a + b*sin_b | b*cos_b - a*sin_a]."""
    a, b = _halves(x, interleaved)
    out_a, out_b = _halves(out, interleaved)
    cos_a, cos_b = _halves(cos, interleaved)
    sin_a, sin_b = _halves(sin, interleaved)
    torch.mul(a, cos_a, out=out_a)
    torch.mul(b, cos_b, out=out_b)
    if transpose:
        out_a.add_(b * sin_b)
        out_b.sub_(a * sin_a)
    else:
        out_a.sub_(b * sin_a)
        out_b.add_(a * sin_b)


class _RopeContext(torch.autograd.function.FunctionCtx):
    """What `_Rope` keeps on its autograd context (for type checking only: autograd makes the object)."""

    interleaved: bool
    saved_tensors: tuple[torch.Tensor, ...]


class _Rope(torch.autograd.Function):
    """`apply_rope`'s autograd: the backward needs only cos and sin."""

    @staticmethod
    def forward(ctx: _RopeContext, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
        rot = freqs.shape[-1]
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        _rotate_into(out[..., :rot], t[..., :rot], cos, sin, interleaved, transpose=False)
        out[..., rot:].copy_(t[..., rot:])
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx: _RopeContext, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        rot = cos.shape[-1]
        grad_t = torch.empty_like(grad, memory_format=torch.contiguous_format)
        _rotate_into(grad_t[..., :rot], grad[..., :rot], cos, sin, ctx.interleaved, transpose=True)
        grad_t[..., rot:].copy_(grad[..., rot:])
        return grad_t, None, None


def apply_rope(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """RoPE of `t` [s, b, heads, d] by the angles `freqs` [s, 1, 1, rot_dim] (rot_dim <= d, even); the
    signature is Transformer Engine's `fused_apply_rotary_pos_emb` (`transpose_output_memory` is ignored, as
    there). Angles are not differentiated."""
    if freqs.shape[-1] % 2 or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"RoPE angles of width {freqs.shape[-1]} do not fit heads of width {t.shape[-1]}")
    return _Rope.apply(t, freqs.detach(), interleaved)


def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """dst = src * scale for each pair of `tensor_lists` = [sources, destinations] (apex's signature); a
    destination that is its source is scaled in place."""
    for src, dst in zip(*tensor_lists, strict=True):
        if src is dst:
            dst.mul_(scale)
        else:
            dst.copy_(src * scale)


def provide() -> None:
    """Install the stand-ins where Megatron would otherwise use its fallbacks (see the module docstring).

    Packed (`thd`) sequences keep needing TE's RoPE kernel: they only occur with TE's attention."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_rope
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale
