"""The SFT schedule: seeded per-epoch shuffles packed into whole-conversation batches under a token budget."""

import itertools

import pytest

from userrl_megatron.config import load_config
from userrl_megatron.config.loader import ConfigError
from userrl_megatron.sft.batches import epoch_batches, fingerprint, schedule, train_batch
from userrl_megatron.sft.trainer import sft_megatron, token_limit


def test_batches_pack_whole_samples_in_the_shuffled_order() -> None:
    lengths = [300, 200, 500, 100, 400, 250]
    batches = epoch_batches(lengths, budget=600, seed=1, epoch=0)
    order = [i for b in batches for i in b]
    assert sorted(order) == list(range(6))  # every sample once per epoch
    for batch in batches:
        assert sum(lengths[i] for i in batch) <= 600
    for batch, after in itertools.pairwise(batches):  # a batch closes only when the next one does not fit
        assert sum(lengths[i] for i in batch) + lengths[after[0]] > 600
    assert batches == epoch_batches(lengths, 600, seed=1, epoch=0)  # a resumed run recomputes the same plan
    assert order != [i for b in epoch_batches(lengths, 600, seed=1, epoch=1) for i in b]  # another epoch, another order
    plan = schedule(lengths, 600, seed=1, epochs=2)
    assert [e for e, _ in plan] == [0] * len(batches) + [1] * len(epoch_batches(lengths, 600, 1, 1))
    with pytest.raises(ValueError, match=r"sample 2 has 500 tokens, more than sft\.batch_tokens = 400"):
        epoch_batches(lengths, 400, seed=1, epoch=0)


def test_train_batch_and_fingerprint() -> None:
    batch = train_batch([[1, 2, 3]], [[0, 1, 1]])
    assert (batch.token_ids, batch.loss_mask, batch.advantages) == ([[1, 2, 3]], [[0, 1, 1]], [[0.0, 0.0, 0.0]])
    assert fingerprint([([1, 2], [0, 1])]) == fingerprint([([1, 2], [0, 1])])
    assert fingerprint([([1, 2], [0, 1])]) != fingerprint([([1, 2], [0, 0])])


def test_sft_settings_drive_the_actor_optimizer() -> None:
    cfg = load_config([], ["sft.lr=2e-5", "sft.warmup_ratio=0.1", "sft.grad_clip=0.5", "sft.lr_schedule=linear"])
    m = sft_megatron(cfg, total_steps=30)
    assert (m.lr, m.lr_warmup_steps, m.lr_decay_steps, m.grad_clip, m.lr_schedule) == (2e-5, 3, 31, 0.5, "linear")
    assert token_limit(cfg) == (2048, "model.max_context_length")
    assert token_limit(load_config([], ["sft.batch_tokens=1000"])) == (1000, "sft.batch_tokens")
    assert token_limit(load_config([], ["sft.max_tokens=512"])) == (512, "sft.max_tokens")


def test_bad_sft_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError) as e:
        load_config([], ["sft.epochs=0", "sft.warmup_ratio=1.5", "sft.lr_schedule=step"])
    assert sorted(e.value.problems) == [
        "sft.epochs must be >= 1, got 0",
        "sft.lr_schedule = 'step'; choose from constant, linear, cosine",
        "sft.warmup_ratio must be in [0, 1], got 1.5",
    ]
