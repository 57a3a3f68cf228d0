"""UserRL's evaluation metrics and their confidence intervals, as pure functions of per-turn rewards.

An *item* is one test task; it has `k` *passes* (episodes sampled from it). Definitions (UserRL `eval/eval.py`
and `analyze.py`, arXiv 2509.19736; tau-bench for pass^k):

* episode return: the sum of its turn rewards;
* `mean` (UserRL `micro_avg`): mean over items of the mean over passes of the episode returns;
* `max` (UserRL `micro_max`): mean over items of the best pass's return;
* TravelGym `travel_score` (`analyze.py`): per episode, the best reward among the `[answer]` turns of each option
  initial (F, H, R, A, C: one per aspect), summed over initials and divided by the scenario's aspect count;
  averaged over passes, then items. `best_choices` / `correct_choices` are the mean counts per episode of turn
  rewards equal to 1.0 / 0.8 (UserRL's `avg_number_of_1` / `avg_number_of_08`, there from the last pass only);
* tau-bench `pass^k`: per task with `c` successes (return 1) in `n` passes, C(c, k) / C(n, k); averaged over tasks.

The 95% confidence interval of `mean` is Student's t interval over the per-item scores (items are the
independent units; passes of one item are not); that of `pass^k` is the same interval over the per-item values
C(c, k) / C(n, k).
"""

import math
from collections.abc import Sequence

SUCCESS_TOL = 1e-6  # tau-bench counts a pass as a success when its reward is 1 within this tolerance
TRAVEL_BEST, TRAVEL_CORRECT = 1.0, 0.8  # TravelGym's choice rewards (best option, correct option)
TAU_GYMS = ("tau", "tau_retail", "tau_airline", "tau2_mock", "tau2_mock_chat", "tau2_airline", "tau2_retail",
            "tau2_telecom", "tau2_telecom_solo")  # fmt: skip

# Two-sided 95% quantiles of Student's t distribution for 1..30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964


def episode_return(turn_rewards: Sequence[float]) -> float:
    """The episode's return: the sum of its turn rewards."""
    return float(sum(turn_rewards))


def mean_over_passes(items: Sequence[Sequence[float]]) -> list[float]:
    """Per item, the mean over its passes (items without a pass are left out)."""
    return [sum(passes) / len(passes) for passes in items if passes]


def micro_avg(items: Sequence[Sequence[float]]) -> float:
    """UserRL `micro_avg`: mean over items of the mean over passes of the episode returns."""
    per_item = mean_over_passes(items)
    return sum(per_item) / len(per_item) if per_item else 0.0


def micro_max(items: Sequence[Sequence[float]]) -> float:
    """UserRL `micro_max`: mean over items of the best pass's return."""
    best = [max(passes) for passes in items if passes]
    return sum(best) / len(best) if best else 0.0


def travel_score(turns: Sequence[tuple[str | None, float]], aspects: int) -> float:
    """`analyze.py`'s TravelGym score of one episode from its (action, reward) turns: for each option initial
    the best reward of the `[answer]` turns naming it, summed, divided by the number of aspects."""
    if aspects < 1:
        raise ValueError(f"a travel scenario has at least one aspect, got {aspects}")
    best: dict[str, float] = {}
    for action, reward in turns:
        if not action or action[:8].lower() != "[answer]":
            continue
        content = action[8:].strip()
        if content:
            best[content[0]] = max(best.get(content[0], reward), reward)
    return sum(best.values()) / aspects


def travel_aspects(task_id: str) -> int:
    """Aspects of a TravelGym scenario id (`flight:2-37|hotel:2-9` has 2; UserRL reads the file's digit suffix)."""
    return len([part for part in task_id.split("|") if part])


def count_reward(turn_rewards: Sequence[float], value: float) -> int:
    """Turns whose reward equals `value` (UserRL counts 1.0 as best and 0.8 as correct TravelGym choices)."""
    return sum(1 for r in turn_rewards if abs(r - value) < 1e-9)


def is_success(episode_return_value: float) -> bool:
    """tau-bench's success: a return of 1."""
    return abs(episode_return_value - 1.0) <= SUCCESS_TOL


def pass_hat_k_items(items: Sequence[Sequence[float]], k: int) -> list[float]:
    """Per item with at least k passes, C(c, k) / C(n, k) (c successes in n passes): the chance that k passes drawn
    without replacement all succeed."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return [
        math.comb(sum(is_success(r) for r in passes), k) / math.comb(len(passes), k)
        for passes in items
        if len(passes) >= k
    ]


def pass_hat_k(items: Sequence[Sequence[float]], k: int) -> float | None:
    """tau-bench pass^k: the mean of `pass_hat_k_items`; items with fewer than k passes are left out; None when no
    item has k passes."""
    values = pass_hat_k_items(items, k)
    return sum(values) / len(values) if values else None


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a table to 30, then Cornish-Fisher)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95% Student t confidence interval of the mean of `values`; None with fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return (mean - half, mean + half)


def welch_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """95% interval of mean(b) - mean(a) for independent samples (Welch's t, Welch-Satterthwaite df)."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return (mb - ma, mb - ma)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile_975(max(1, math.floor(df))) * se
    return (mb - ma - half, mb - ma + half)
