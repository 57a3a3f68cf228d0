"""tools/bench_train.py's synthetic batch: what `--trained-share` trains."""

from collections.abc import Callable

import pytest

from tests.support.tools import load_tool


@pytest.fixture(scope="module")
def make_batch() -> Callable:
    return load_tool("bench_train").make_batch


@pytest.mark.parametrize(("share", "trained"), [(1.0, 7), (0.5, 4), (0.1, 1), (0.0, 1)])
def test_the_last_share_of_each_episode_is_trained_never_its_first_token(
    make_batch: Callable, share: float, trained: int
) -> None:
    batch = make_batch(vocab=50, episodes=3, seq_len=8, trained_share=share)
    assert batch.loss_mask == [[0] * (8 - trained) + [1] * trained] * 3
    for mask, advantages in zip(batch.loss_mask, batch.advantages, strict=True):
        assert [a != 0 for a in advantages] == [m == 1 for m in mask]
    assert all(len(ids) == 8 and all(0 <= t < 50 for t in ids) for ids in batch.token_ids)
