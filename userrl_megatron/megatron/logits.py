"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary on one rank.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary. The log-partition
function is a logsumexp of the per-rank logsumexps (one all-gather of a scalar per position), the target
logit comes from the one rank that holds it (one all-reduce of a scalar per position), and the entropy
needs one more all-reduce. Columns past the real vocabulary (Megatron's padding rows) are excluded, so the
results equal the unpadded HF model's.

Gradients flow through Megatron's mappings: `gather_from_tensor_model_parallel_region` (all-gather
forward, keep-own-slice backward) and `reduce_from_tensor_model_parallel_region` (all-reduce forward,
identity backward); both are exact here because every TP rank computes the same loss from the gathered or
reduced values. The fused `logsumexp` keeps the forward pass to one read of the logits.
"""

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

# Stands in for -inf on padding columns: its exp() is exactly 0, and 0 · it stays finite in the entropy.
PAD_LOGIT = -1.0e30


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and (optionally) the entropy at every position of `logits` [..., V/tp].

    `labels` [...] holds global token ids (negative ids are scored as token 0; callers mask them out).
    `vocab_size` is the real vocabulary: padded columns at or beyond it never receive probability.
    `entropy_grad=False` computes the entropy outside the autograd graph (for metrics only).
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    logits = logits.float()
    width = logits.shape[-1]
    start = tp_rank * width
    real = min(max(vocab_size - start, 0), width)
    if real < width:
        column = torch.arange(width, device=logits.device)
        logits = logits.masked_fill(column >= real, PAD_LOGIT)

    log_z = torch.logsumexp(logits, dim=-1)
    if tp_size > 1:
        log_z = torch.logsumexp(gather_from_tensor_model_parallel_region(log_z.unsqueeze(-1)), dim=-1)

    local = labels.clamp(min=0) - start
    here = (local >= 0) & (local < width)
    target = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * here
    logprobs = reduce_from_tensor_model_parallel_region(target) - log_z

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.exp(logits - log_z.unsqueeze(-1))
            entropy = log_z - reduce_from_tensor_model_parallel_region((probs * logits).sum(dim=-1))
    return logprobs, entropy
