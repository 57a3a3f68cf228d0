"""The chunked vocab-parallel log-probs (megatron/logits.py) against plain torch, with chunks small enough that
every pass crosses chunk boundaries: values, entropy and gradients, with and without padded vocabulary columns
(fp32 logits of an unpadded vocabulary are read in place, never written)."""

import pytest
import torch


@pytest.mark.parametrize("width", [56, 50])  # 6 padded columns, as Megatron pads the vocabulary; none
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_log_softmax(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, width: int) -> None:
    # imported here: importing megatron.core at collection changes how this process pickles tensors for servers
    from userrl_megatron.megatron import logits as chunked

    vocab = 50
    monkeypatch.setattr(chunked.parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(chunked.parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 4 * width)  # 4 rows a chunk: 21 rows make 6 chunks
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, width, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (3, 7), generator=gen)
    before = logits.detach().clone()

    logprobs, entropy = chunked.vocab_parallel_logprobs(logits, labels, vocab, with_entropy=True)
    (0.7 * logprobs.sum() + 0.3 * entropy.sum()).backward()
    grad, logits.grad = logits.grad.clone(), None

    reference = torch.log_softmax(logits.float()[..., :vocab], dim=-1)
    want_logprobs = reference.gather(-1, labels[..., None]).squeeze(-1)
    want_entropy = -(reference.exp() * reference).sum(-1)
    (0.7 * want_logprobs.sum() + 0.3 * want_entropy.sum()).backward()

    assert (logprobs - want_logprobs).abs().max() <= 2e-6
    assert (entropy - want_entropy).abs().max() <= 2e-6
    assert (grad.float() - logits.grad.float()).abs().max() <= 1e-6
    assert torch.equal(logits.detach(), before)
    if width > vocab:
        assert grad[..., vocab:].abs().max() == 0  # padding columns get no gradient

    # the entropy as a metric only: no gradient from it, the log-probs' gradient unchanged
    logits.grad = None
    logprobs, metric_only = chunked.vocab_parallel_logprobs(logits, labels, vocab, True, entropy_grad=False)
    assert not metric_only.requires_grad
    assert (metric_only - want_entropy).abs().max() <= 2e-6
    logprobs.sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    torch.log_softmax(logits.float()[..., :vocab], dim=-1).gather(-1, labels[..., None]).sum().backward()
    assert (grad.float() - logits.grad.float()).abs().max() <= 1e-6
