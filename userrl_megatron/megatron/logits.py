"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary on one rank.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. The log-softmax needs
only three all-reduces over the TP group of per-position scalars: the max, the sum of exponentials and the
target logit (and one more for the entropy). Columns past the real vocabulary (Megatron's padding rows)
are excluded, so results equal the unpadded HF model's.

The sums go through Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity
backward), which is the correct gradient because every TP rank computes the same loss from the reduced
values.
"""

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

# Stands in for -inf on padding columns: exp() of it is exactly 0, and 0 · it stays finite in the entropy.
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
    tp_group = parallel_state.get_tensor_model_parallel_group()
    logits = logits.float()
    width = logits.shape[-1]
    start = tp_rank * width
    real = min(max(vocab_size - start, 0), width)
    if real < width:
        column = torch.arange(width, device=logits.device)
        logits = logits.masked_fill(column >= real, PAD_LOGIT)

    with torch.no_grad():
        top = logits.max(dim=-1).values
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local = labels.clamp(min=0) - start
    here = (local >= 0) & (local < width)
    target = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * here
    logprobs = reduce_from_tensor_model_parallel_region(target) - log_z

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            expected = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1)) / sum_exp
            entropy = log_z - expected
    return logprobs, entropy
