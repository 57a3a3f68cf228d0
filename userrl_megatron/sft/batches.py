"""The SFT schedule: which samples each optimizer step trains on, computable from the step number alone.

Each epoch shuffles the samples with a seed of (run seed, epoch), then packs them in that order into batches of
whole conversations of at most `sft.batch_tokens` tokens (a new batch starts when the next one does not fit).
The plan of every epoch has the same number of steps only by chance, so the schedule lists every epoch's
batches up front; step k (1-based) of the run is batch k of that list. A resumed run recomputes the same list
and continues at the step after its checkpoint's: the exact samples it would have trained on.
"""

import hashlib
import random
from collections.abc import Sequence

from userrl_megatron.types import TrainBatch


def epoch_batches(lengths: Sequence[int], budget: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices of each batch of `epoch`: a seeded shuffle, packed in order up to `budget` tokens."""
    order = list(range(len(lengths)))
    random.Random(f"sft:{seed}:{epoch}").shuffle(order)
    batches: list[list[int]] = []
    used = budget  # forces a new batch for the first sample
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than sft.batch_tokens = {budget}")
        if used + lengths[i] > budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += lengths[i]
    return batches


def schedule(lengths: Sequence[int], budget: int, seed: int, epochs: int) -> list[tuple[int, list[int]]]:
    """(epoch, sample indices) of every optimizer step of the run, in order."""
    return [(epoch, batch) for epoch in range(epochs) for batch in epoch_batches(lengths, budget, seed, epoch)]


def fingerprint(samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str:
    """A short hash of the samples' ids and masks: a resume checks it trains on the same data."""
    digest = hashlib.sha256()
    for ids, mask in samples:
        digest.update(repr((list(ids), list(mask))).encode())
    return digest.hexdigest()[:16]


def train_batch(token_ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> TrainBatch:
    """The actor's TrainBatch of some samples (the SFT loss ignores the advantages, left at zero)."""
    return TrainBatch(
        token_ids=[list(t) for t in token_ids],
        loss_mask=[list(m) for m in masks],
        advantages=[[0.0] * len(t) for t in token_ids],
    )
