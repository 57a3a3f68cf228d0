"""tools/bench_train.py's synthetic batch: what `--trained-share` trains."""

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def make_batch() -> Callable:
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "tools" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_batch


@pytest.mark.parametrize(("share", "trained"), [(1.0, 7), (0.5, 4), (0.1, 1), (0.0, 1)])
def test_the_last_share_of_each_episode_is_trained_never_its_first_token(
    make_batch: Callable, share: float, trained: int
) -> None:
    batch = make_batch(vocab=50, episodes=3, seq_len=8, trained_share=share)
    assert batch.loss_mask == [[0] * (8 - trained) + [1] * trained] * 3
    for mask, advantages in zip(batch.loss_mask, batch.advantages, strict=True):
        assert [a != 0 for a in advantages] == [m == 1 for m in mask]
    assert all(len(ids) == 8 and all(0 <= t < 50 for t in ids) for ids in batch.token_ids)
