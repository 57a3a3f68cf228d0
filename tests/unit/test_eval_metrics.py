"""UserRL's evaluation metrics against hand-computed cases: mean/max over passes, TravelGym's per-aspect score,
tau-bench's pass^k, the confidence intervals, and the per-gym aggregation of episode records."""

from typing import Any

import pytest

from userrl_megatron.eval import metrics as m
from userrl_megatron.eval.results import aggregate, gym_results, markdown_table, report_rows

# Three items, two passes each, as per-turn rewards: returns A (1, 0), B (1.1, 1.0), C (0, 0.5).
TURNS = {"A": [[0, 0, 1], [0, 0]], "B": [[0.4, 0.7], [1.0]], "C": [[0], [0.2, 0.3]]}


def returns() -> list[list[float]]:
    return [[m.episode_return(p) for p in passes] for passes in TURNS.values()]


def test_mean_over_items_of_mean_over_passes_of_summed_turn_rewards() -> None:
    assert m.micro_avg(returns()) == pytest.approx((0.5 + 1.05 + 0.25) / 3)  # 0.6
    assert m.micro_avg(returns()) == pytest.approx(0.6)


def test_max_over_passes() -> None:
    assert m.micro_max(returns()) == pytest.approx((1 + 1.1 + 0.5) / 3)


def test_items_without_a_scored_pass_are_left_out() -> None:
    assert m.micro_avg([[1.0], []]) == 1.0
    assert m.micro_avg([]) == 0.0


def test_travel_score_takes_the_best_answer_per_option_initial_over_the_aspects() -> None:
    turns = [
        ("[search] hotels in Rome", 0.2),  # search and elicitation rewards do not count
        ("[action] Which floor do you like?", 0.6),
        ("[answer] H3", 0.8),  # correct hotel
        ("[answer] H1", 0.0),  # a second hotel: refused, 0; the hotel keeps 0.8
        ("[answer] F2", 1.0),  # best flight
    ]
    assert m.travel_score(turns, 3) == pytest.approx((0.8 + 1.0) / 3)
    assert m.travel_aspects("flight:2-1|hotel:2-2|restaurant:3-4") == 3
    assert m.travel_score([(None, 0.0), ("[finish]", 0.0)], 2) == 0.0
    with pytest.raises(ValueError, match="at least one aspect"):
        m.travel_score([], 0)


def test_tau_pass_hat_k() -> None:
    # Four passes per task; successes 4, 2 and 0.
    items = [[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]
    assert m.pass_hat_k(items, 1) == pytest.approx((1 + 2 / 4 + 0) / 3)
    assert m.pass_hat_k(items, 2) == pytest.approx((1 + 1 / 6 + 0) / 3)  # C(2,2)/C(4,2) = 1/6
    assert m.pass_hat_k(items, 4) == pytest.approx(1 / 3)
    assert m.pass_hat_k([[1.0]], 2) is None  # no task has two passes
    assert m.pass_hat_k([[0.9999999, 0.5]], 1) == pytest.approx(0.5)  # a return of 1 within 1e-6 succeeds


def test_student_t_interval() -> None:
    low, high = m.t_interval([0, 1, 1, 0])  # mean 0.5, sd sqrt(1/3), t(3) = 3.182
    half = 3.182 * (1 / 3) ** 0.5 / 2
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))
    assert m.t_interval([0.3]) is None
    assert m.t_interval([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5))
    assert m.t_quantile_975(40) == pytest.approx(2.0211, abs=2e-4)  # beyond the table: Cornish-Fisher
    assert m.t_quantile_975(1000) == pytest.approx(1.9623, abs=2e-4)


def test_welch_interval_of_a_difference() -> None:
    # var(a)/n = (1/3)/4, var(b)/n = (1/4)/4; Welch df = 5.88 -> 5, t(5) = 2.571
    low, high = m.welch_interval([0, 1, 0, 1], [1, 1, 1, 0])
    half = 2.571 * (1 / 12 + 1 / 16) ** 0.5
    assert (low, high) == pytest.approx((0.25 - half, 0.25 + half))


def record(gym: str, task: str, turns: list[tuple[str, float]], sample: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "gym": gym,
        "task_id": task,
        "sample": sample,
        "turn_rewards": [r for _, r in turns],
        "reward": sum(r for _, r in turns),
        "turns": [{"action": a, "reward": r} for a, r in turns],
        **extra,
    }


def test_gym_results_leave_infrastructure_failures_out_of_the_score() -> None:
    records = [
        record("function", "f1", [("[answer] 3", 1.0)], 0),
        record("function", "f1", [("[answer] 2", 0.0)], 1, infra_failed=True, finish_reason="engine_error"),
        record("function", "f2", [("[answer] 2", 0.0)], 0),
        record("function", "f2", [("[answer] 5", 1.0)], 1),
        record("function", "f3", [], 0, infra_failed=True),
        record("function", "f3", [], 1, infra_failed=True),
    ]
    entry = gym_results("function", records, samples=2)
    assert entry["items"] == 2 and entry["items_unscored"] == 1
    assert entry["episodes"] == 6 and entry["infra_failed"] == 3
    assert entry["metrics"] == {"mean": pytest.approx((1.0 + 0.5) / 2), "max": 1.0}
    assert entry["ci95"]["mean"] == pytest.approx([0.75 - 12.706 * 0.25, 0.75 + 12.706 * 0.25], abs=1e-6)


def test_travel_and_tau_entries_and_the_item_weighted_overall_score() -> None:
    travel_id = "flight:2-1|hotel:2-2"
    records = [
        record("travel", travel_id, [("[search] f", 0.2), ("[answer] F1", 1.0), ("[answer] H2", 0.8)], 0),
        record("travel", travel_id, [("[action] q", 0.6), ("[answer] H2", 0.8)], 1),
        record("tau_retail", "retail-0", [("[action] hi", 0.0), ("[answer] {}", 1.0)], 0),
        record("tau_retail", "retail-0", [("[answer] {}", 0.0)], 1),
        record("tau_retail", "retail-1", [("[answer] {}", 1.0)], 0),
        record("tau_retail", "retail-1", [("[answer] {}", 1.0)], 1),
    ]
    results = aggregate(records, samples=2)
    travel = results["gyms"]["travel"]["metrics"]
    assert travel["mean"] == pytest.approx((2.0 + 1.4) / 2)  # summed turn rewards, as UserRL's micro_avg
    assert travel["travel_score"] == pytest.approx((1.8 / 2 + 0.8 / 2) / 2)  # 0.65
    assert travel["best_choices"] == pytest.approx(0.5) and travel["correct_choices"] == pytest.approx(1.0)
    tau = results["gyms"]["tau_retail"]["metrics"]
    assert tau["pass^1"] == pytest.approx((0.5 + 1) / 2) and tau["pass^2"] == pytest.approx((0 + 1) / 2)
    assert tau["mean"] == pytest.approx(0.75)
    assert results["gyms"]["tau_retail"]["ci95"]["pass^2"] == pytest.approx([0.5 - 12.706 * 0.5, 0.5 + 12.706 * 0.5])
    # overall: travel_score for travel (1 item), mean elsewhere (2 items)
    assert results["overall"]["score"] == pytest.approx((0.65 * 1 + 0.75 * 2) / 3)
    assert results["overall"]["items"] == 3 and results["overall"]["episodes"] == 6


def test_report_table_lines_up() -> None:
    results = aggregate([record("function", "f1", [("[answer] 1", 1.0)])], samples=1)
    table = markdown_table(*report_rows(results))
    lines = table.splitlines()
    assert lines[0].startswith("| gym      | items | episodes | infra failed | mean  | 95% CI | max   |")
    assert lines[2].startswith("| function | 1     | 1        | 0            | 1.000 | -      | 1.000 |")
    assert len({len(line) for line in lines}) == 1


def test_tau2_gyms_report_pass_hat_k_with_intervals_for_every_k_up_to_the_samples() -> None:
    """Three tau2_airline tasks, 3 passes each; an infrastructure failure is left out (SPEC.md §11)."""
    passes = {"0": [1.0, 1.0, 1.0], "1": [1.0, 0.0, 1.0], "2": [0.0, 0.0, 0.0]}
    records = [record("tau2_airline", task, [("[action] ###STOP###", r)], i) for task, rs in passes.items()
               for i, r in enumerate(rs)]  # fmt: skip
    records.append({**record("tau2_airline", "2", [("[action] hi", 0.0)], 3), "infra_failed": True})
    entry = gym_results("tau2_airline", records, samples=3)
    per_task = {1: [1.0, 2 / 3, 0.0], 2: [1.0, 1 / 3, 0.0], 3: [1.0, 0.0, 0.0]}  # C(c, k) / C(3, k)
    for k, values in per_task.items():
        mean = sum(values) / 3
        sd = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
        half = 4.303 * sd / 3**0.5  # Student t, 2 degrees of freedom
        assert entry["metrics"][f"pass^{k}"] == pytest.approx(mean, abs=1e-6)
        assert entry["ci95"][f"pass^{k}"] == pytest.approx([mean - half, mean + half], abs=1e-6)
    assert entry["infra_failed"] == 1 and "pass^4" not in entry["metrics"]
    _, rows = report_rows(aggregate(records, samples=3))
    assert rows[0][-1].startswith("pass^1 0.556 [") and "pass^3 0.333 [" in rows[0][-1]
