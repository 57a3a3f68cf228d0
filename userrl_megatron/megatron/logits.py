"""Log-probabilities and entropy from vocab-parallel logits, in token chunks, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary. Per position, the
log-partition function is a logsumexp of the per-rank logsumexps (one all-gather of a scalar), the target logit
comes from the one rank that holds it (one all-reduce), and the entropy's expected logit needs one more
all-reduce. Columns past the real vocabulary (Megatron's padding) are excluded, so the results equal the
unpadded HF model's.

Memory: a [tokens, vocab / TP] fp32 copy of the logits, its softmax and, in training, its gradient were each as
large as the logits: at a 150k vocabulary, 16 bytes per token and column, the largest temporaries of a step.
Here the forward and the backward turn at most `CHUNK_ELEMENTS` logits at a time into fp32, and keep only a few
numbers per position between them; the backward writes the gradient (in the logits' dtype) chunk by chunk. What
remains is the logits themselves and their gradient. The backward is closed-form: d log p(t) / d x_j = 1[j = t]
- p_j and d H / d x_j = p_j (E_p[x] - x_j), with the global log-partition and E_p[x] saved by the forward, so it
needs no collective.

Time: fp32 logits of an unpadded vocabulary are read in place (no copy); the forward exponentiates each logit once
(log Z and the entropy's E_p[x] share the exponentials, so the entropy metric costs a multiply-add) into one
chunk-sized buffer reused by every chunk (a fresh large tensor per chunk costs its page faults again on CPU); the
backward builds fp32 gradients in their output rows.
"""

import torch
from megatron.core import parallel_state

# Stands in for -inf on padding columns: its exp() is exactly 0, and 0 · it stays finite in the entropy.
PAD_LOGIT = -1.0e30
CHUNK_ELEMENTS = 1 << 24  # logits turned into fp32 at a time (64 MiB, a few such temporaries per chunk)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and (optionally) the entropy at every position of `logits` [..., V/tp], in fp32.

    `labels` [...] holds global token ids (negative ids are scored as token 0; callers mask them out).
    `vocab_size` is the real vocabulary: padded columns at or beyond it never receive probability.
    `entropy_grad=False` makes the entropy a metric only (no gradient flows from it).
    """
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    real = min(max(vocab_size - start, 0), width)
    flat_labels = labels.reshape(-1)
    local = flat_labels.clamp(min=0) - start
    here = (local >= 0) & (local < width)
    logprobs, entropy = _ChunkedLogprobs.apply(
        logits.reshape(-1, width), local.clamp(0, width - 1), here, real, with_entropy, entropy_grad
    )
    return logprobs.view(labels.shape), entropy.view(labels.shape) if with_entropy else None


def _chunk(logits: torch.Tensor, begin: int, end: int, real: int) -> torch.Tensor:
    """Rows [begin, end) in fp32, padding columns at PAD_LOGIT: a copy when the logits are in another dtype or
    padded, else a view (read only)."""
    if real < logits.shape[-1]:
        x = logits[begin:end].to(torch.float32, copy=True)
        x[:, real:] = PAD_LOGIT
        return x
    return logits[begin:end].float()


class _Context(torch.autograd.function.FunctionCtx):
    """The attributes `_ChunkedLogprobs` keeps on its autograd context (only for type checking: autograd makes
    the context object)."""

    real: int
    step: int
    entropy_grad: bool
    saved_tensors: tuple[torch.Tensor, ...]


class _ChunkedLogprobs(torch.autograd.Function):
    """(log p(target), entropy) per row of [rows, V/tp] logits; see the module docstring."""

    @staticmethod
    def forward(
        ctx: _Context,
        logits: torch.Tensor,
        index: torch.Tensor,
        here: torch.Tensor,
        real: int,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = logits.shape
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        log_z = torch.empty(rows, dtype=torch.float32, device=logits.device)
        target = torch.empty_like(log_z)
        expected = torch.zeros_like(log_z)  # E_p[x] under this rank's softmax, then globally
        scratch = torch.empty(min(step, rows), width, dtype=torch.float32, device=logits.device)
        for begin in range(0, rows, step):
            end = min(begin + step, rows)
            x = _chunk(logits, begin, end, real)
            peak = x.amax(dim=-1, keepdim=True)
            # the one exp of the forward (log Z and E_p[x] both come from it), in memory reused across chunks
            scaled = torch.sub(x, peak, out=scratch[: end - begin]).exp_()
            total = scaled.sum(dim=-1)
            log_z[begin:end] = total.log() + peak.squeeze(-1)
            target[begin:end] = x.gather(-1, index[begin:end, None]).squeeze(-1) * here[begin:end]
            if with_entropy:
                expected[begin:end] = scaled.mul_(x).sum(dim=-1) / total
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.empty_like(log_z) for _ in range(tp)]
            torch.distributed.all_gather(parts, log_z, group=group)
            local_z, log_z = log_z, torch.logsumexp(torch.stack(parts), dim=0)
            torch.distributed.all_reduce(target, group=group)
            if with_entropy:
                expected = torch.exp(local_z - log_z) * expected
                torch.distributed.all_reduce(expected, group=group)
        ctx.save_for_backward(logits, index, here, log_z, expected)
        ctx.real, ctx.step, ctx.entropy_grad = real, step, with_entropy and entropy_grad
        entropy = log_z - expected if with_entropy else torch.zeros_like(log_z)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return target - log_z, entropy

    @staticmethod
    def backward(
        ctx: _Context, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, index, here, log_z, expected = ctx.saved_tensors
        grad = torch.empty_like(logits)
        rows = logits.shape[0]
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_z)
        scratch = None
        if grad.dtype != torch.float32:
            scratch = torch.empty(min(ctx.step, rows), logits.shape[1], dtype=torch.float32, device=logits.device)
        for begin in range(0, rows, ctx.step):
            end = min(begin + ctx.step, rows)
            x = _chunk(logits, begin, end, ctx.real)
            # fp32 logits: the gradient is built in place in its output rows, with no temporary of that size
            g = grad[begin:end] if scratch is None else scratch[: end - begin]
            torch.sub(x, log_z[begin:end, None], out=g).exp_()  # p
            g_lp = grad_logprobs[begin:end, None]
            if ctx.entropy_grad and grad_entropy is not None:
                g.mul_(grad_entropy[begin:end, None] * (expected[begin:end, None] - x) - g_lp)
            else:
                g.mul_(-g_lp)
            g.scatter_add_(-1, index[begin:end, None], g_lp * here[begin:end, None])
            if g.dtype != grad.dtype:
                grad[begin:end] = g
        return grad, None, None, None, None, None
