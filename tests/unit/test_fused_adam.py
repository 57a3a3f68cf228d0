"""`optimizer.use_fused_adam`: torch's AdamW inside Megatron's optimizers steps CPU fp32 parameters with its fused
kernel, which makes the same update as its per-tensor loop up to rounding."""

from types import SimpleNamespace

import torch


def _adamw(params: list[torch.nn.Parameter], **kwargs: object) -> torch.optim.AdamW:
    no_decay = [p for p in params if p.dim() == 1]
    groups = [{"params": [p for p in params if p.dim() > 1]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, **kwargs)


def _copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def test_cpu_adamw_runs_fused_with_the_same_updates() -> None:
    # imported here: importing megatron.core at collection changes how this process pickles tensors for servers
    from userrl_megatron.megatron.optimizer import use_fused_adam

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((33, 17), (17,), (5, 5))]
    switched, fused, loop = params, _copies(params), _copies(params)
    inner = _adamw(switched)
    use_fused_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)]))  # type: ignore[arg-type]
    assert [(g["fused"], g["foreach"]) for g in inner.param_groups] == [(True, False), (True, False)]
    optimizers = [inner, _adamw(fused, fused=True), _adamw(loop, foreach=False)]
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for opt, group in zip(optimizers, (switched, fused, loop), strict=True):
            for p, g in zip(group, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b, c in zip(switched, fused, loop, strict=True):
        assert torch.equal(a, b)  # the fused kernel, bit for bit
        assert (a - c).abs().max() <= 1e-6  # the per-tensor loop's update, up to rounding
