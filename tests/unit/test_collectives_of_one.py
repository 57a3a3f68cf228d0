"""`optimizer.alone_is_identity`: the distributed optimizer's all-gather and reduce-scatter over a group of one
rank do nothing (the shard is the whole buffer), over larger groups they call through unchanged."""

from types import SimpleNamespace
from typing import Any

import torch


def _recording() -> tuple[list[tuple[Any, ...]], Any]:
    calls: list[tuple[Any, ...]] = []

    def collective(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        calls.append((output, input, args, kwargs))
        return "work"

    return calls, collective


def test_a_group_of_one_makes_no_call_and_leaves_output_equal_to_input() -> None:
    # imported here: importing megatron.core at collection changes how this process pickles tensors for servers
    from userrl_megatron.megatron.optimizer import alone_is_identity

    calls, collective = _recording()
    run = alone_is_identity(collective)
    buffer = torch.arange(8.0)
    assert run(buffer, buffer[:8], group=SimpleNamespace(size=lambda: 1), async_op=True) is None
    assert torch.equal(buffer, torch.arange(8.0))  # in place: untouched
    output = torch.zeros(2, 4)
    assert run(output, torch.arange(8.0), op="sum", group=SimpleNamespace(size=lambda: 1)) is None
    assert torch.equal(output.view(-1), torch.arange(8.0))  # other memory: a copy
    assert calls == []


def test_a_larger_group_calls_through() -> None:
    from userrl_megatron.megatron.optimizer import alone_is_identity

    calls, collective = _recording()
    out, inp, group = torch.zeros(4), torch.ones(2), SimpleNamespace(size=lambda: 2)
    assert alone_is_identity(collective)(out, inp, group=group, async_op=False) == "work"
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is inp
    assert calls[0][3] == {"group": group, "async_op": False}
    assert torch.equal(out, torch.zeros(4))


def test_installed_once_over_megatrons_own_globals() -> None:
    from megatron.core.distributed import param_and_grad_buffer

    from userrl_megatron.megatron.optimizer import skip_collectives_of_one

    before = (param_and_grad_buffer.dist_all_gather_func, param_and_grad_buffer.dist_reduce_scatter_func)
    try:
        skip_collectives_of_one()
        first = (param_and_grad_buffer.dist_all_gather_func, param_and_grad_buffer.dist_reduce_scatter_func)
        skip_collectives_of_one()
        assert (param_and_grad_buffer.dist_all_gather_func, param_and_grad_buffer.dist_reduce_scatter_func) == first
        assert all(getattr(f, "skips_groups_of_one", False) for f in first)
    finally:
        param_and_grad_buffer.dist_all_gather_func, param_and_grad_buffer.dist_reduce_scatter_func = before
