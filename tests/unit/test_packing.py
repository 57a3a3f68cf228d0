"""Data-parallel balancing, token-budget micro-batches and model-input layouts (pure torch)."""

import re

import pytest
import torch

from userrl_megatron.megatron.packing import (
    balance,
    packed_input,
    padded_input,
    rows_tensor,
    split_micro_batches,
    to_rows,
    trained_positions,
    zigzag_positions,
)


def test_balance_puts_longest_first_on_the_lightest_rank() -> None:
    lengths = [10, 3, 8, 7, 2, 6]
    # 10 -> r0 (10), 8 -> r1 (8), 7 -> r1 (15), 6 -> r0 (16), 3 -> r1 (18), 2 -> r0 (18)
    assert balance(lengths, 2) == [[0, 4, 5], [1, 2, 3]]
    assert balance([5], 3) == [[0], [], []]
    loads = [sum(lengths[i] for i in g) for g in balance(lengths, 2)]
    assert loads == [18, 18]


def test_padded_micro_batches_count_padding() -> None:
    lengths = [10, 9, 4, 4, 3]
    # budget 20: [10, 9] costs 2 x 10 = 20; [4, 4, 3] costs 3 x 4 = 12
    assert split_micro_batches(range(5), lengths, 20, packed=False) == [[0, 1], [2, 3, 4]]
    # packed: 10 + 9 = 19, then 4 + 4 + 3 = 11 fits into nothing before -> first-fit: [10, 9], [4, 4, 3]
    assert split_micro_batches(range(5), lengths, 20, packed=True) == [[0, 1], [2, 3, 4]]
    # packed with alignment 4 (12, 12, 4, 4, 4): 12 + 12 > 20, so 10 and 9 part; first fit puts 4, 4 after
    # the 10 (12 + 4 + 4 = 20) and the 3 after the 9
    assert split_micro_batches(range(5), lengths, 20, packed=True, align=4) == [[0, 2, 3], [1, 4]]


def test_an_episode_longer_than_the_budget_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=re.escape("episode 1 has 33 tokens, more than megatron.micro_batch_tokens = 32")
    ):
        split_micro_batches([0, 1], [4, 33], 32, packed=False)


def test_padded_input_scores_each_next_token() -> None:
    inp = padded_input([[5, 6, 7], [8, 9]], align=4)
    assert inp.tokens.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert inp.labels.tolist() == [[6, 7, -1, -1], [9, -1, -1, -1]]
    assert inp.row.tolist() == [[0, 0, 0, -1], [1, 1, -1, -1]]
    assert inp.col.tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]
    assert inp.position_ids.tolist() == [[0, 1, 2, 3]] * 2


def test_packed_input_without_context_parallelism() -> None:
    inp = packed_input([[5, 6, 7], [8, 9]], align=2)
    assert inp.tokens.tolist() == [[5, 6, 7, 0, 8, 9]]
    assert inp.labels.tolist() == [[6, 7, -1, -1, 9, -1]]
    assert inp.row.tolist() == [[0, 0, 0, -1, 1, 1]]
    assert inp.cu_seqlens.tolist() == [0, 4, 6]
    assert inp.max_seqlen == 4


def test_zigzag_split_balances_causal_work() -> None:
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_packed_input_keeps_this_context_parallel_rank_positions() -> None:
    seqs = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    halves = [packed_input(seqs, align=4, cp=2, cp_rank=r) for r in range(2)]
    assert halves[0].tokens.tolist() == [[1, 2, 7, 0, 8, 0]]  # seq 0 padded to 8, seq 1 to 4
    assert halves[1].tokens.tolist() == [[3, 4, 5, 6, 9, 10]]
    assert halves[0].labels.tolist() == [[2, 3, -1, -1, 9, -1]]
    assert all(h.cu_seqlens.tolist() == [0, 8, 12] for h in halves)
    # together the ranks score every next token exactly once
    scored = sorted((int(r), int(c)) for h in halves for r, c in zip(h.row[h.scored], h.col[h.scored], strict=True))
    assert scored == [(0, t) for t in range(6)] + [(1, t) for t in range(2)]
    with pytest.raises(ValueError, match="align 2 must be a multiple of 2 x context parallel size 2"):
        packed_input(seqs, align=2, cp=2, cp_rank=0)


def test_to_rows_places_each_score_on_the_token_it_scores() -> None:
    inp = packed_input([[5, 6, 7], [8, 9]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5]])
    rows = to_rows(values, inp, rows=2, width=3)
    assert torch.equal(rows, torch.tensor([[0.0, 0.1, 0.2], [0.0, 0.4, 0.0]]))


def test_trained_positions_index_the_hidden_states_and_score_like_the_full_input() -> None:
    seqs, mask = [[5, 6, 7], [8, 9]], rows_tensor([[0, 1, 1], [0, 0]], 3)  # tokens 6 and 7 trained, row 1 not
    # Padded [b=2, s=3]: the model's hidden states are [s, b], flattened to s * 2 + b.
    index, sub = trained_positions(padded_input(seqs), mask)
    assert index.tolist() == [0, 2]  # (b0, s0) and (b0, s1): the positions predicting tokens 6 and 7
    assert (sub.labels.tolist(), sub.row.tolist(), sub.col.tolist()) == ([[6, 7]], [[0, 0]], [[0, 1]])
    assert to_rows(torch.tensor([[0.5, 0.25]]), sub, rows=2, width=3).tolist() == [[0.0, 0.5, 0.25], [0.0] * 3]
    # Packed [1, 6] (the sequences padded to 4 and 2 positions): the flat index is the position.
    mask = rows_tensor([[0, 0, 1], [0, 1]], 3)
    index, sub = trained_positions(packed_input(seqs, align=2), mask)
    assert index.tolist() == [1, 4] and sub.labels.tolist() == [[7, 9]]
    assert trained_positions(padded_input(seqs), torch.zeros(2, 3)) is None


def test_rows_tensor_right_pads() -> None:
    assert rows_tensor([[1.0], [2.0, 3.0]], 3).tolist() == [[1.0, 0.0, 0.0], [2.0, 3.0, 0.0]]


@pytest.mark.parametrize(("loss_agg", "expected"), [("token-mean", 8.0), ("seq-mean-token-sum", 2.0)])
def test_loss_normaliser_counts_each_row_once_across_context_parallel_ranks(loss_agg: str, expected: float) -> None:
    """Megatron sums the per-rank counts over data- and context-parallel ranks: with CP=2 the total must be the
    CP=1 normaliser (8 scored tokens, 2 rows), or the gradients come out halved."""
    from userrl_megatron.megatron.actor import loss_count

    seqs = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    whole = packed_input(seqs)
    halves = [packed_input(seqs, align=4, cp=2, cp_rank=r) for r in range(2)]
    assert loss_count(loss_agg, 2, float(whole.scored.sum()), cp_rank=0) == expected
    assert sum(loss_count(loss_agg, 2, float(h.scored.sum()), cp_rank=r) for r, h in enumerate(halves)) == expected
