"""tools/bench_async.py's analysis: smoothing, time to a reward level, reward at equal wall time, the report."""

import argparse
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.tools import load_tool

bench = load_tool("bench_async")


def run(seed: int, curve: list[float], step_seconds: list[float]) -> dict[str, Any]:
    """A run's figures as bench_async keeps them, from made-up metrics records."""
    records = [
        {"rollout/reward_mean": r, "timing/step": s, "timing/rollout": s}
        for r, s in zip(curve, step_seconds, strict=True)
    ]
    return {"seed": seed, **bench.run_figures(records)}


def test_run_figures_keep_the_curve_its_wall_clock_and_the_group_counters() -> None:
    records = [
        {"rollout/reward_mean": 1.0, "timing/step": 10.0, "timing/rollout": 8.0, "timing/train": 1.0},
        {"rollout/reward_mean": 2.0, "timing/step": 20.0, "timing/rollout": 6.0, "timing/train": 2.0},
        {"rollout/reward_mean": 3.0, "timing/step": 30.0, "timing/rollout": 4.0},
        {"rollout/reward_mean": 4.0, "timing/step": 30.0, "timing/rollout": 2.0, "timing/train": 3.0},
    ]
    for i, counts in enumerate([(10, 8, 2, 0, 1), (8, 8, 3, 1, 2), (6, 5, 1, 0, 1), (4, 4, 0, 0, 0)]):
        started, used, carried, dropped, stale = counts
        records[i] |= {"rollout/groups_started": started, "rollout/groups_used": used}
        records[i] |= {"rollout/groups_carried": carried, "rollout/groups_dropped": dropped}
        records[i] |= {"rollout/staleness_max": stale, "batch/stale_groups": float(dropped)}
    figures = bench.run_figures(records)
    assert figures["reward_curve"] == [1.0, 2.0, 3.0, 4.0]
    assert figures["step_seconds"] == [10.0, 20.0, 30.0, 30.0]
    assert figures["elapsed_seconds"] == [10.0, 30.0, 60.0, 90.0]
    assert figures["steps_per_hour"] == 160.0
    assert figures["final_reward"] == 3.0  # the last 3 steps
    assert figures["rollout_seconds_mean"] == 5.0 and figures["train_seconds_mean"] == 1.5
    assert (figures["groups_started"], figures["groups_used"], figures["groups_dropped"]) == (28, 25, 1)
    assert figures["groups_carried"] == 0  # in flight at the end, not a sum
    assert figures["staleness_max"] == 2 and figures["stale_groups_dropped"] == 1.0


def test_smoothed_is_a_trailing_mean_over_what_there_is() -> None:
    assert bench.smoothed([0.0, 3.0, 0.0, 3.0], window=3) == [0.0, 1.5, 1.0, 2.0]
    assert bench.smoothed([0.0, 3.0, 0.0, 3.0], window=1) == [0.0, 3.0, 0.0, 3.0]
    assert bench.smoothed([], window=3) == []


def test_one_lucky_step_does_not_reach_the_level_a_smoothed_step_does() -> None:
    curve, elapsed = [1.0, 2.0, 0.5, 2.0, 2.0, 2.0], [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    # Smoothed: 1, 1.5, 1.1667, 1.5, 1.5, 2: step 2's raw 2.0 (t = 20 s) is below 1.6 once smoothed.
    assert bench.time_to_level(curve, elapsed, 1.6, window=3) == 60.0
    assert bench.time_to_level(curve, elapsed, 1.6, window=1) == 20.0
    assert bench.time_to_level(curve, elapsed, 1.5, window=3) == 20.0  # the level itself counts as reached


def test_a_curve_that_never_reaches_the_level_has_no_time() -> None:
    assert bench.time_to_level([1.0, 2.0, 0.5, 2.0], [1.0, 2.0, 3.0, 4.0], 2.5, window=3) is None


def test_reward_at_an_equal_wall_time_with_uneven_step_times() -> None:
    curve, elapsed = [0.0, 3.0, 0.0, 3.0], [5.0, 35.0, 40.0, 50.0]  # steps of 5, 30, 5 and 10 s
    assert bench.reward_at(curve, elapsed, 4.0, window=3) is None  # no step finished yet
    assert bench.reward_at(curve, elapsed, 34.9, window=3) == 0.0  # the 30 s step is still running
    assert bench.reward_at(curve, elapsed, 35.0, window=3) == 1.5
    assert bench.reward_at(curve, elapsed, 45.0, window=3) == 1.0
    assert bench.reward_at(curve, elapsed, 100.0, window=3) == 2.0  # past the end: the last step's


def test_late_rise_is_what_the_smoothed_curve_gained_over_its_last_steps() -> None:
    curve = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert bench.late_rise(curve, steps=6, window=1) == 6.0
    assert bench.late_rise(curve, steps=6, window=3) == 5.5  # smoothed 6 - smoothed 0.5
    assert bench.late_rise(curve[:6], steps=6, window=3) is None


def test_summary_ignores_nones_and_counts_them() -> None:
    assert bench.summary([1.0, None, 3.0, 2.0]) == {
        "mean": 2.0,
        "std": 1.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
        "missing": 1,
    }
    assert bench.summary([2.5]) == {"mean": 2.5, "std": None, "min": 2.5, "max": 2.5, "n": 1, "missing": 0}
    assert bench.summary([None]) == {"mean": None, "std": None, "min": None, "max": None, "n": 0, "missing": 1}


def test_median_time_counts_never_as_slowest() -> None:
    assert bench.median_time([10.0, None, 30.0]) == 30.0
    assert bench.median_time([10.0, 20.0, 30.0, None]) == 25.0
    assert bench.median_time([10.0, None, None]) is None
    assert bench.median_time([10.0, 20.0, None, None]) is None  # the middle pair includes a never
    assert bench.faster(10.0, 20.0) and bench.faster(10.0, None)
    assert not bench.faster(20.0, 20.0) and not bench.faster(None, 5.0) and not bench.faster(None, None)


SYNC = [run(1, [0.0, 1.0, 2.0, 3.0], [10.0] * 4), run(2, [1.0, 2.0, 3.0, 4.0], [10.0] * 4)]
SLOW = [run(1, [0.0] * 4, [10.0, 10.0, 10.0, 11.0]), run(2, [0.0] * 4, [10.0, 10.0, 10.0, 11.0])]


def test_the_report_when_the_fast_mode_is_done() -> None:
    fast = [run(1, [0.0, 3.0, 0.0, 3.0], [4.0] * 4), run(2, [1.0, 1.0, 1.0, 4.0], [4.0] * 4)]
    report = bench.compare({"sync": SYNC, "fast": fast, "slow": SLOW}, level_fraction=0.5, window=3)
    assert report["level"] == 1.25  # 0.5 x sync's mean final reward, (2 + 3) / 2
    assert report["equal_time_s"] == 16.0  # the shortest run's total: fast's 4 x 4 s
    sync, fast_report, slow = (report["modes"][m] for m in ("sync", "fast", "slow"))
    # sync smoothed: 0, 0.5, 1, 2 and 1, 1.5, 2, 3; fast: 0, 1.5, 1, 2 and 1, 1, 1, 2.
    assert sync["time_to_level_s"] == [40.0, 20.0] and sync["time_to_level_median_s"] == 30.0
    assert fast_report["time_to_level_s"] == [8.0, 16.0] and fast_report["time_to_level_median_s"] == 12.0
    assert slow["time_to_level_s"] == [None, None] and slow["reached_level"] == 0
    assert slow["time_to_level"]["missing"] == 2 and slow["time_to_level_median_s"] is None
    assert sync["reward_at_equal_time"] == [0.0, 1.0]  # by 16 s sync finished one step of 10 s
    assert fast_report["reward_at_equal_time"] == [2.0, 2.0]
    assert sync["final_reward"]["min"] == 2.0 and sync["final_reward"]["max"] == 3.0
    assert fast_report["final_reward"]["mean"] == 2.0 and fast_report["steps_per_hour"]["mean"] == 900.0
    assert sync["late_rise"]["n"] == 0  # 4 steps: too short for the last 6
    assert report["best_async_mode"] == "fast"
    assert report["speedup"] == 2.5 and report["reward_gap"] == -0.5
    assert report["reaches_level_faster"] is True
    assert report["final_reward_within_sync_spread"] is True  # sync's min included
    better = [run(1, [3.0] * 4, [4.0] * 4), run(2, [4.0] * 4, [4.0] * 4)]  # above sync's best seed: not worse
    assert bench.compare({"sync": SYNC, "fast": better})["final_reward_within_sync_spread"] is True
    text = bench.table(report)
    assert "fastest async mode fast: 2.50x" in text and all(m in text for m in ("sync", "fast", "slow"))


def test_the_report_when_the_fast_mode_is_not_done() -> None:
    fast = [run(1, [0.0, 3.0, 0.0, 3.0], [4.0] * 4), run(2, [1.0] * 4, [4.0] * 4)]
    report = bench.compare({"sync": SYNC, "fast": fast}, level_fraction=0.5, window=3)
    assert report["modes"]["fast"]["time_to_level_s"] == [8.0, None]
    assert report["modes"]["fast"]["time_to_level_median_s"] is None  # half the seeds never got there
    assert report["reaches_level_faster"] is False
    assert report["modes"]["fast"]["final_reward"]["mean"] == 1.5  # below sync's min, 2
    assert report["final_reward_within_sync_spread"] is False
    assert report["reward_gap"] == pytest.approx(-1.0)


def test_sync_alone_has_no_verdict_and_the_json_is_rounded() -> None:
    report = bench.compare({"sync": SYNC})
    assert "best_async_mode" not in report and report["level"] == pytest.approx(2.25)
    assert bench.rounded({"a": [1 / 3, None, 2], "b": {"c": 2 / 3}}) == {"a": [0.3333, None, 2], "b": {"c": 0.6667}}
    assert "fastest" not in bench.table(report)


def test_main_runs_every_mode_per_seed_and_keeps_every_curve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, int, int]] = []

    def fake_run_mode(name: str, seed: int, policy: Path, scratch: Path, args: Any) -> dict[str, Any]:
        calls.append((name, seed, args.steps))
        step = 4.0 if name == "one_step_off_os" else 10.0
        return run(seed, [0.5 + 0.1 * i + 0.01 * seed for i in range(args.steps)], [step] * args.steps)

    tiny_run = ModuleType("tests.support.tiny_run")
    tiny_run.learning_policy = lambda scratch: scratch / "policy"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests.support.tiny_run", tiny_run)
    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--quick", "--out", str(out)])
    bench.main()
    modes = ["sync", "one_step_off", "one_step_off_os"]
    assert calls == [(m, seed, 12) for seed in (1, 2) for m in modes]  # seed-major: load drift hits every mode
    report = json.loads(out.read_text())
    assert report["settings"]["seeds"] == [1, 2] and report["settings"]["steps"] == 12
    assert [r["seed"] for r in report["runs"]["sync"]] == [1, 2]
    assert len(report["runs"]["one_step_off_os"][1]["reward_curve"]) == 12
    assert report["best_async_mode"] == "one_step_off_os" and report["speedup"] == 2.5
    assert capsys.readouterr().out.splitlines()[-1].startswith("fastest async mode one_step_off_os: 2.50x")


def test_a_step_without_rollout_statistics_has_no_reward_and_every_figure_skips_it() -> None:
    """A step trained entirely on groups carried from earlier steps logs no rollout/reward_mean."""
    records: list[dict[str, Any]] = [{"timing/step": 10.0, "timing/rollout": 1.0} for _ in range(5)]
    for record, reward in zip(records, [1.0, None, 3.0, None, 5.0], strict=True):
        if reward is not None:
            record["rollout/reward_mean"] = reward
    figures = bench.run_figures(records)
    curve, elapsed = figures["reward_curve"], figures["elapsed_seconds"]
    assert curve == [1.0, None, 3.0, None, 5.0]
    assert figures["final_reward"] == 4.0  # the known rewards of the last 3 steps
    assert bench.smoothed(curve, window=3) == [1.0, 1.0, 2.0, 3.0, 4.0]
    assert bench.smoothed([None, None, 2.0], window=2) == [None, None, 2.0]
    assert bench.time_to_level(curve, elapsed, 3.0, window=3) == 40.0
    assert bench.time_to_level([None, None], [1.0, 2.0], 0.0, window=1) is None
    assert bench.reward_at([2.0, None], [10.0, 20.0], 25.0, window=1) == 2.0  # the last step that has one
    assert bench.reward_at([None, 2.0], [10.0, 20.0], 15.0, window=1) is None
    assert bench.late_rise([0.0, 1.0, None, 3.0], steps=3, window=1) == 3.0
    assert bench.late_rise([None, 1.0, 2.0, 3.0], steps=3, window=1) is None
    report = bench.compare({"sync": SYNC, "gappy": [{"seed": 1, **figures}]}, level_fraction=0.5, window=3)
    assert report["modes"]["gappy"]["time_to_level_s"] == [30.0]  # smoothed 2.0 at step 3 reaches 1.25
    assert report["modes"]["gappy"]["final_reward"]["mean"] == 4.0 and "gappy" in bench.table(report)


def test_keep_runs_in_its_folder_with_every_step_dumped_and_drops_the_checkpoints(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tests.support.tiny_run as tiny_run

    seen: dict[str, str] = {}

    def fake_train(overrides: list[str], timeout_s: float) -> list[dict[str, Any]]:
        for override in overrides:  # later overrides win, as in `userrl train`
            key, value = override.split("=", 1)
            seen[key] = value
        run_dir = Path(seen["run.output_dir"]) / seen["run.name"]
        (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
        (run_dir / "rollouts").mkdir()
        (run_dir / "metrics.jsonl").write_text("{}\n")
        return [{"rollout/reward_mean": 1.0, "timing/step": 1.0, "timing/rollout": 1.0}] * 3

    monkeypatch.setattr(tiny_run, "train", fake_train)
    keep = tmp_path / "kept"
    args = argparse.Namespace(median=0.2, p99=5.0, steps=3, keep=str(keep))
    figures = bench.run_mode("one_step_off_os", 7, tmp_path / "policy", tmp_path / "scratch", args)
    assert figures["seed"] == 7 and figures["reward_curve"] == [1.0] * 3
    assert (seen["run.output_dir"], seen["run.name"]) == (str(keep), "one_step_off_os-seed7")
    assert seen["logging.rollout_dump_every"] == "1" and int(seen["logging.rollout_dump_count"]) >= 96
    run_dir = keep / "one_step_off_os-seed7"
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "rollouts").is_dir()
    assert not (run_dir / "checkpoints").exists()
    seen.clear()
    args.keep = ""
    bench.run_mode("sync", 7, tmp_path / "policy", tmp_path / "scratch", args)
    assert seen["run.output_dir"] == str(tmp_path / "scratch") and seen["logging.rollout_dump_every"] == "0"


def test_keep_refuses_a_folder_that_holds_one_of_its_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "sync-seed2").mkdir()
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--quick", "--keep", str(tmp_path)])
    with pytest.raises(SystemExit, match="already holds sync-seed2"):
        bench.main()
