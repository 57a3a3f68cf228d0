"""`megatron/kernels.py`: the one-pass RoPE equals Megatron's unfused RoPE bit for bit, forward and backward, the
in-place multi-tensor scale equals Megatron's fallback, and both are what Megatron calls where Transformer Engine
and apex are absent."""

from collections.abc import Callable

import pytest
import torch

SEQ, BATCH, HEADS, DIM = 7, 3, 4, 16


def _angles(rot_dim: int, interleaved: bool, generic: bool) -> torch.Tensor:
    """[s, 1, 1, rot_dim] angles laid out as Megatron's RotaryEmbedding does, or arbitrary ones (`generic`)."""
    if generic:
        return torch.randn(SEQ, 1, 1, rot_dim, dtype=torch.float32) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(SEQ, dtype=torch.float32), inv)
    emb = torch.stack((freqs, freqs), dim=-1).flatten(-2) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _run(
    fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = t.detach().clone().requires_grad_()
    view = leaf.view(SEQ, BATCH, HEADS, 2 * DIM)[..., :DIM]  # strided, as q comes out of the fused QKV
    out = fn(view)
    out.backward(grad)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_dim", [DIM, DIM // 2])
@pytest.mark.parametrize("generic", [False, True])
def test_equals_megatrons_unfused_rope_bit_for_bit(
    dtype: torch.dtype, interleaved: bool, rot_dim: int, generic: bool
) -> None:
    # imported here: importing megatron.core at collection changes how this process pickles tensors for servers
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from userrl_megatron.megatron.kernels import apply_rope

    torch.manual_seed(0)
    freqs = _angles(rot_dim, interleaved, generic)
    t = torch.randn(SEQ, BATCH, HEADS, 2 * DIM).to(dtype)
    grad = torch.randn(SEQ, BATCH, HEADS, DIM).to(dtype)
    ours = _run(lambda x: apply_rope(x, freqs, interleaved=interleaved), t, grad)
    theirs = _run(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved), t, grad)
    assert ours[0].dtype == dtype and ours[0].is_contiguous()
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], t.view(SEQ, BATCH, HEADS, 2 * DIM)[..., :DIM])  # it did rotate


def test_angles_that_do_not_fit_the_heads_are_refused() -> None:
    from userrl_megatron.megatron.kernels import apply_rope

    t = torch.zeros(SEQ, BATCH, HEADS, DIM)
    with pytest.raises(ValueError, match="RoPE angles of width 18 do not fit heads of width 16"):
        apply_rope(t, torch.zeros(SEQ, 1, 1, DIM + 2))
    with pytest.raises(ValueError, match="RoPE angles of width 5 do not fit heads of width 16"):
        apply_rope(t, torch.zeros(SEQ, 1, 1, 5))


def test_megatron_calls_the_rope_as_its_fused_rope_and_a_kernel_already_there_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from tests.support.tiny_models import tiny_config
    from userrl_megatron.config import MegatronConfig
    from userrl_megatron.convert.arch import Architecture
    from userrl_megatron.megatron import kernels
    from userrl_megatron.megatron.model import transformer_config

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    arch = Architecture.from_hf_config(tiny_config("qwen3").to_dict())
    config = transformer_config(arch, MegatronConfig(), torch.float32, use_te=False)
    assert config.apply_rope_fusion is True
    assert rope_utils.fused_apply_rotary_pos_emb is kernels.apply_rope

    def kernel(
        t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
    ) -> torch.Tensor:
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", kernel)
    kernels.provide()
    assert rope_utils.fused_apply_rotary_pos_emb is kernel
    t, freqs = torch.randn(SEQ, BATCH, HEADS, DIM), _angles(DIM, False, False)
    assert rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=object()) is t  # Megatron's dispatch


def test_multi_tensor_scale_equals_megatrons_fallback_and_scales_in_place() -> None:
    from megatron.core.utils import local_multi_tensor_scale

    from userrl_megatron.megatron.kernels import multi_tensor_scale

    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7)]
    expected = [g.clone() for g in grads]
    local_multi_tensor_scale(0, None, [expected, expected], 0.37)
    pointers = [g.data_ptr() for g in grads]
    multi_tensor_scale(0, torch.zeros(1, dtype=torch.int), [grads, grads], 0.37)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert [g.data_ptr() for g in grads] == pointers
    sources, copies = [torch.randn(4)], [torch.zeros(4, dtype=torch.float64)]
    multi_tensor_scale(0, torch.zeros(1, dtype=torch.int), [sources, copies], 2.0)  # a copy into another dtype
    assert torch.equal(copies[0], (sources[0] * 2.0).double())
    with pytest.raises(ValueError):
        multi_tensor_scale(0, torch.zeros(1, dtype=torch.int), [sources, []], 2.0)


def test_gradient_clipping_uses_the_in_place_scale_unless_apex_provides_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_scale

    from userrl_megatron.megatron import kernels

    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale)
    monkeypatch.setattr(megatron_optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale)
    kernels.provide()
    assert clip_grads.multi_tensor_scale_impl is kernels.multi_tensor_scale
    assert megatron_optimizer.multi_tensor_scale_impl is kernels.multi_tensor_scale

    def apex_kernel(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, scale: float) -> None:
        pass

    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", apex_kernel)
    kernels.provide()
    assert clip_grads.multi_tensor_scale_impl is apex_kernel
