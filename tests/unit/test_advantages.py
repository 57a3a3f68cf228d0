"""grpo_multiturn against a worked example of UserRL's estimator (arXiv 2509.19736); hand vectors; properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from userrl_megatron.algo import (
    AdvantageInputs,
    compute_advantages,
    credit_turns,
    episode_advantages,
    group_normalize,
    grpo_multiturn_advantages,
    score_trajectory,
)
from userrl_megatron.config import AlgoConfig


def layout(tokens_per_turn: list[list[int]], gap: int = 1, pad: int = 2) -> torch.Tensor:
    """turn_index [B, L]: each turn's tokens, then `gap` untrained (tool) tokens; rows right-padded with -1."""
    rows = []
    for turns in tokens_per_turn:
        row = [-1] * 3  # an untrained prompt
        for t, n in enumerate(turns):
            row += [t] * n + [-1] * gap
        rows.append(row)
    width = max(len(r) for r in rows) + pad
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows])


def per_turn(adv: torch.Tensor, turn_index: torch.Tensor) -> list[list[float]]:
    """The value shared by all tokens of each turn (asserting they agree)."""
    out = []
    for b in range(adv.shape[0]):
        values = []
        for t in range(int(turn_index[b].max()) + 1):
            cells = adv[b][turn_index[b] == t]
            assert torch.all(cells == cells[0])
            values.append(float(cells[0]))
        out.append(values)
    return out


# --- worked example: gamma 0.8, eps 1e-6, one group of four ------------------------------------------
REWARDS = [[0, 0.2, 1.0], [0, 0, 0], [1.0], [0.2, 0]]
TOKENS = [[4, 3, 2], [2, 2, 2], [3], [2, 4]]
TABLE = {
    ("Equalized", "Sum"): [[0.055555] * 3, [-0.833331] * 3, [1.388886], [-0.611110] * 2],
    ("Equalized", "R2G"): [[0.630125] * 3, [-1.050208] * 3, [1.050208], [-0.630125] * 2],
    ("R2G", "Sum"): [[0.048780, 0.060975, 0.060975], [0, 0, 0], [1.388886], [-0.611110, 0]],
    ("R2G", "R2G"): [[0.553280, 0.691600, 0.691600], [0, 0, 0], [1.050208], [-0.630125, 0]],
    ("EM", "Sum"): [[0.041174, 0.056869, 0.082348], [-0.833331] * 3, [1.388886], [-0.748904, -0.542213]],
    ("EM", "R2G"): [[0.467005, 0.645027, 0.934010], [-1.050208] * 3, [1.050208], [-0.772207, -0.559084]],
}


@pytest.mark.parametrize(("turn_level", "score"), list(TABLE))
def test_spec_table(turn_level: str, score: str) -> None:
    ti = layout(TOKENS)
    adv = grpo_multiturn_advantages(REWARDS, ["g"] * 4, ti, 0.8, turn_level, score)
    assert adv.dtype == torch.float32 and adv.shape == ti.shape
    got = per_turn(adv, ti)
    for row, expected in zip(got, TABLE[(turn_level, score)], strict=True):
        assert row == pytest.approx(expected, abs=1e-6)
    assert torch.all(adv[ti < 0] == 0)  # prompt, tool tokens and padding get nothing


def test_spec_scores_and_credits() -> None:
    assert [score_trajectory(r, "Sum", 0.8) for r in REWARDS] == [0.4, 0.0, 1.0, 0.1]
    assert [score_trajectory(r, "R2G", 0.8) for r in REWARDS] == pytest.approx([0.8, 0.0, 1.0, 0.2])
    assert credit_turns(REWARDS[0], "R2G", 0.8) == pytest.approx([0.8, 1.0, 1.0])
    assert credit_turns(REWARDS[3], "R2G", 0.8) == pytest.approx([0.2, 0.0])
    em = {0: 0.5, 0.1: 0.6048, 0.1667: 0.6639, 0.2: 0.6906, 0.3333: 0.7814, 0.5: 0.8655, 0.8: 0.9615, 1.0: 1.0}
    assert credit_turns(list(em), "EM", 0.8) == list(em.values())
    assert score_trajectory([], "Sum", 0.8) == 0.0


# --- independent hand-computed vectors ------------------------------------------------------------------
def test_hand_vector_r2g_credit_redistribution() -> None:
    # Group of two, gamma 0.5. A: rewards [0, 1], 2 tokens per turn -> credits [0.5, 1].
    # Sum scores: A 0.5, B 0.0 -> mean 0.25, unbiased std sqrt(2 * 0.25^2) = 0.353553...
    # z_A = 0.25 / (0.3535534 + 1e-6); N = 4, sum c*L = 0.5*2 + 1*2 = 3 -> turn0 z*0.5*4/3, turn1 z*4/3.
    # B has credits [0, 0]: zero advantage although z_B < 0.
    z = 0.25 / (math.sqrt(0.125) + 1e-6)
    ti = layout([[2, 2], [3, 1]])
    adv = grpo_multiturn_advantages([[0.0, 1.0], [0.0, 0.0]], [7, 7], ti, 0.5, "R2G", "Sum")
    assert per_turn(adv, ti)[0] == pytest.approx([z * 2 / 3, z * 4 / 3], abs=1e-6)
    assert torch.all(adv[1] == 0)


def test_hand_vector_three_groups_equalized() -> None:
    # Group x: scores 0.5, 0.0, 0.5 (mean 1/3, unbiased std sqrt(1/12)); group y: a single trajectory with
    # score 0.25 -> mean 0, std 1 -> z = 0.25 / (1 + 1e-6).
    s = math.sqrt(1 / 12) + 1e-6
    rewards = [[1.0, 0.0], [0.0], [0.5, 0.5, 0.5], [0.25]]
    ti = layout([[1, 2], [3], [1, 1, 1], [2]])
    adv = grpo_multiturn_advantages(rewards, ["x", "x", "x", "y"], ti, 0.8, "Equalized", "Sum")
    expected = [[(0.5 - 1 / 3) / s] * 2, [(0 - 1 / 3) / s], [(0.5 - 1 / 3) / s] * 3, [0.25 / (1 + 1e-6)]]
    for row, exp in zip(per_turn(adv, ti), expected, strict=True):
        assert row == pytest.approx(exp, abs=1e-6)


def test_hand_vector_without_std_and_rounding() -> None:
    # Sum rounds the mean to 4 dp: 1/3 -> 0.3333; norm_by_std=False leaves score - mean.
    ti = layout([[1, 1, 1], [1]])
    adv = grpo_multiturn_advantages([[1.0, 0.0, 0.0], [0.0]], [0, 0], ti, 0.8, "Equalized", "Sum", norm_by_std=False)
    got = per_turn(adv, ti)
    assert got[0] == pytest.approx([0.3333 / 2] * 3, abs=1e-7) and got[1] == pytest.approx([-0.3333 / 2], abs=1e-7)


def test_tokens_of_turns_without_reward_get_nothing() -> None:
    # The policy's last turn was truncated out of the reward list: its tokens get 0 and do not count in N.
    ti = layout([[2, 2], [2]])
    adv = grpo_multiturn_advantages([[1.0], [0.0]], ["g", "g"], ti, 0.8, "Equalized", "Sum")
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert per_turn(adv, ti)[0] == pytest.approx([z, 0.0], abs=1e-6)


def test_registry_grpo_outcome_uses_episode_return() -> None:
    ti = layout([[2, 1], [1]])
    inputs = AdvantageInputs([[0.5, 0.5], [0.0]], ["g", "g"], ti)
    adv = compute_advantages(inputs, AlgoConfig(adv_estimator="grpo"))
    z = 0.5 / (math.sqrt(0.5) + 1e-6)  # returns 1.0 and 0.0: mean 0.5, unbiased std sqrt(0.5)
    assert torch.allclose(adv[0][ti[0] >= 0], torch.tensor(z, dtype=torch.float32))
    assert torch.allclose(adv[1][ti[1] >= 0], torch.tensor(-z, dtype=torch.float32))
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'"):
        compute_advantages(inputs, AlgoConfig(adv_estimator="nope"))


def test_episode_advantages_ragged_round_trip() -> None:
    cfg = AlgoConfig(turn_level="Equalized", trajectory_score="Sum")
    out = episode_advantages([[1.0], [0.0]], ["g", "g"], [[-1, 0, 0], [-1, -1, 0, 0, -1]], cfg)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert [len(o) for o in out] == [3, 5]
    assert out[0] == pytest.approx([0, z, z], abs=1e-6) and out[1] == pytest.approx([0, 0, -z, -z, 0], abs=1e-6)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="turn_level must be one of"):
        grpo_multiturn_advantages([[1.0]], [0], layout([[1]]), 0.8, "Linear", "Sum")
    with pytest.raises(ValueError, match="trajectory_score must be one of"):
        grpo_multiturn_advantages([[1.0]], [0], layout([[1]]), 0.8, "R2G", "Max")
    with pytest.raises(ValueError, match="turn_index must be"):
        grpo_multiturn_advantages([[1.0], [0.0]], [0, 0], layout([[1]]), 0.8, "R2G", "Sum")
    with pytest.raises(ValueError, match="2 scores but 1 group ids"):
        group_normalize([1.0, 2.0], [0])


# --- properties -------------------------------------------------------------------------------------------
reward = st.sampled_from([0.0, 0.1, 0.2, 1 / 6, 0.5, 0.8, 1.0])


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[list[float]], list[int], list[list[int]]]:
    n = draw(st.integers(1, 8))
    rewards = [draw(st.lists(reward, min_size=1, max_size=5)) for _ in range(n)]
    groups = [draw(st.integers(0, 2)) for _ in range(n)]
    tokens = [[draw(st.integers(1, 4)) for _ in r] for r in rewards]
    return rewards, groups, tokens


@settings(max_examples=150, deadline=None)
@given(batches())
def test_equalized_sum_is_plain_grpo_on_mean_reward(batch: tuple) -> None:
    rewards, groups, tokens = batch
    ti = layout(tokens)
    adv = grpo_multiturn_advantages(rewards, groups, ti, 0.8, "Equalized", "Sum")
    means = [round(sum(r) / len(r), 4) for r in rewards]
    for b in range(len(rewards)):
        members = [means[i] for i in range(len(rewards)) if groups[i] == groups[b]]
        if len(members) == 1:
            z = means[b] / (1 + 1e-6)
        else:
            mu = sum(members) / len(members)
            sd = math.sqrt(sum((m - mu) ** 2 for m in members) / (len(members) - 1))
            z = (means[b] - mu) / (sd + 1e-6)
        assert torch.allclose(adv[b][ti[b] >= 0], torch.tensor(z, dtype=torch.float32), atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(["Equalized", "R2G", "EM"]), st.sampled_from(["Sum", "R2G"]))
def test_mean_over_credited_tokens_is_the_normalised_score(batch: tuple, turn_level: str, score: str) -> None:
    rewards, groups, tokens = batch
    ti = layout(tokens)
    adv = grpo_multiturn_advantages(rewards, groups, ti, 0.8, turn_level, score).double()
    z = group_normalize([score_trajectory(r, score, 0.8) for r in rewards], groups)
    for b, r in enumerate(rewards):
        credits = credit_turns(r, turn_level, 0.8)
        credited = torch.tensor([credits[t] != 0 if t >= 0 else False for t in ti[b].tolist()])
        if sum(c * n for c, n in zip(credits, tokens[b], strict=True)) == 0:
            assert torch.all(adv[b] == 0)
        else:
            assert float(adv[b][credited].mean()) == pytest.approx(float(z[b]), abs=1e-5)


@settings(max_examples=100, deadline=None)
@given(st.lists(reward, min_size=1, max_size=4), st.integers(2, 6), st.sampled_from(["Equalized", "R2G", "EM"]))
def test_identical_scores_give_zero(rewards: list[float], n: int, turn_level: str) -> None:
    ti = layout([[2] * len(rewards)] * n)
    adv = grpo_multiturn_advantages([rewards] * n, [0] * n, ti, 0.8, turn_level, "R2G")
    assert torch.all(adv == 0)
