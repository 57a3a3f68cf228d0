"""Asynchronous rollout modes against `sync` on heavy-tailed multi-turn episodes, on CPU, over several seeds.

A tiny Qwen3 policy (character tokenizer, warmed up to answer with a random letter of "abcd") learns EchoGym
(alphabet "a", 3 turns, graded per-turn rewards) through the real `userrl train`: Ray, the Megatron actor, the
embedded engine, weight sync. The simulated user answers each step after a log-normal delay (median 200 ms,
p99 5 s by default: an API model's long tail), so a step's rollout waits for its slowest groups. Modes, same
seeds and settings:

    sync               rollout, train, push
    one_step_off       the next step's rollout runs while this step trains
    one_step_off_os    one_step_off + partial rollouts + over-sampling (train on the first groups to finish
                       with signal; unfinished groups carry over and may lag 2 versions: max_staleness 2)

Every mode runs once per seed (seed-major order, so a drift in the machine's load touches all modes alike), from
one warmed-up policy. A seed sets `run.seed` (task order, Megatron's RNG), `rollout.embedded.random_seed` (the
engine's token sampling) and `gyms.echo.seed` (the user's reply delays). 40 steps by default: sync's curves
still rose at step 24 (smoothed rise over the last 6 steps 0.33) and had flattened by step 40 (0.05); `late_rise`
in the report says whether they flattened by the end.

Kept per mode and seed: the reward curve (`rollout/reward_mean` per step; None for a step served entirely from
groups carried from earlier steps, which logs no rollout statistics: every figure below skips it), each step's wall
seconds (`timing/step`) and their running sum (the curve's wall clock, start-up excluded), steps/hour, the final
reward (mean of the last 3 steps), the group counters. Reported from those (`compare`): a reward level, 0.9 x
sync's mean final reward; per mode, the wall time at which each seed's smoothed reward (trailing mean of 3 steps)
first reaches it, the smoothed reward at an equal wall time (the shortest run's total, which every run has
reached), and summaries (mean, sample std, min, max) of these, of the final reward, of steps/hour and of
`late_rise`. Top level: the fastest asynchronous mode by mean steps/hour, its `speedup` over sync, and the issue's
two checks: `reaches_level_faster` (its median time to the level is below sync's; a seed that never reaches it
counts as slower than any that does) and `final_reward_within_sync_spread` (its mean final reward is not below
sync's worst seed: within sync's spread, or above it). A table of these ends the output.

`--keep DIR` keeps every run's directory, DIR/<mode>-seed<N>/, to diagnose a run afterwards: config.yaml, run.log,
metrics.jsonl (every metric of every step, not only the figures above), the engines' logs and a rollout dump of
every step with every episode that finished in it (rollouts/step_N.jsonl: its group, and per turn its tokens,
reward and weight version). The final checkpoint is removed once a run finishes (it adds nothing to a
diagnosis; a run that fails keeps it). Writing the dumps adds a little to each step's time.

    python tools/bench_async.py --out bench_async.json            # 5 seeds x 3 modes x 40 steps: about 2 hours
    python tools/bench_async.py --quick --out bench_async.json    # 2 seeds x 12 steps, a smoke run: ~15 min
    python tools/bench_async.py --seed-list 1,2,3,4,5,6,7 --steps 30 --median 0.2 --p99 5
    python tools/bench_async.py --seed-list 3 --modes sync,one_step_off_os --keep runs/bench_async
"""

import argparse
import itertools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES: dict[str, list[str]] = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "one_step_off_os": [
        "rollout.mode=one_step_off",
        "rollout.partial=true",
        "rollout.over_sample_groups=4",
        "rollout.max_staleness=2",
    ],
}
FINAL_STEPS = 3  # the final reward: the mean over this many last steps
WINDOW = FINAL_STEPS  # smoothing window: the smoothed reward at the last step is the final reward
LEVEL_FRACTION = 0.9  # the reward level: this share of sync's mean final reward
LATE_STEPS = 6  # late_rise: the smoothed reward gained over this many last steps
GROUP_COUNTERS = ("groups_started", "groups_used", "groups_carried", "groups_dropped")
DUMP_ALL = 1_000_000  # logging.rollout_dump_count with --keep: more episodes than a step ever finishes


def seed_overrides(seed: int) -> list[str]:
    """What a seed changes: task order and Megatron's RNG, the engine's sampling, the user's delays."""
    return [f"run.seed={seed}", f"rollout.embedded.random_seed={seed}", f"gyms.echo.seed={seed}"]


def run_name(mode: str, seed: int) -> str:
    """A run's `run.name`, and its folder under --keep."""
    return f"{mode}-seed{seed}"


def run_figures(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl records (one per step, in order). A step whose groups all came from
    earlier steps (over-sampling) logs no rollout statistics: its reward is None."""
    rewards: list[float | None] = [r.get("rollout/reward_mean") for r in records]
    step_seconds = [r["timing/step"] for r in records]
    elapsed = list(itertools.accumulate(step_seconds))
    out: dict[str, Any] = {
        "steps": len(records),
        "reward_curve": rewards,
        "step_seconds": step_seconds,
        "elapsed_seconds": elapsed,
        "steps_per_hour": 3600 * len(records) / elapsed[-1],
        "final_reward": known_mean(rewards[-FINAL_STEPS:]),
        "rollout_seconds_mean": statistics.fmean(r["timing/rollout"] for r in records),
        "train_seconds_mean": statistics.fmean(r.get("timing/train", 0.0) for r in records),
    }
    stale = [r["rollout/staleness_max"] for r in records if "rollout/staleness_max" in r]
    if stale:
        out["staleness_max"] = max(stale)
    for key in GROUP_COUNTERS:
        values = [r[f"rollout/{key}"] for r in records if f"rollout/{key}" in r]
        if values:  # groups_carried is a level (what is in flight), the others count per step
            out[key] = values[-1] if key == "groups_carried" else sum(values)
    out["stale_groups_dropped"] = sum(r.get("batch/stale_groups", 0.0) for r in records)
    return out


def known_mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None if every one is."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def smoothed(curve: Sequence[float | None], window: int = WINDOW) -> list[float | None]:
    """Trailing moving average of the known rewards (the first steps average what there is), so one lucky step
    reaches no level; None where the window holds no reward."""
    return [known_mean(curve[max(0, i + 1 - window) : i + 1]) for i in range(len(curve))]


def time_to_level(
    curve: Sequence[float | None], elapsed: Sequence[float], level: float, window: int = WINDOW
) -> float | None:
    """Wall seconds at the first step whose smoothed reward is >= level; None if none is."""
    pairs = zip(elapsed, smoothed(curve, window), strict=True)
    return next((t for t, r in pairs if r is not None and r >= level), None)


def reward_at(curve: Sequence[float | None], elapsed: Sequence[float], t: float, window: int = WINDOW) -> float | None:
    """The smoothed reward at the last step finished by wall time t that has one; None if no step has."""
    done = [r for e, r in zip(elapsed, smoothed(curve, window), strict=True) if e <= t and r is not None]
    return done[-1] if done else None


def late_rise(curve: Sequence[float | None], steps: int = LATE_STEPS, window: int = WINDOW) -> float | None:
    """Smoothed reward gained over the last `steps` steps (near 0: flattened); None if the curve is too short or
    either end has no smoothed reward."""
    if len(curve) <= steps:
        return None
    s = smoothed(curve, window)
    first, last = s[-1 - steps], s[-1]
    return None if first is None or last is None else last - first


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std (None below 2 values), min, max and count of the values that are not None; `missing`
    counts the Nones (e.g. seeds that never reached a level)."""
    known = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(known) if known else None,
        "std": statistics.stdev(known) if len(known) > 1 else None,
        "min": min(known, default=None),
        "max": max(known, default=None),
        "n": len(known),
        "missing": len(values) - len(known),
    }


def median_time(times: Sequence[float | None]) -> float | None:
    """Median over seeds, a None (never reached) counting as slower than any time; None if the median is one."""
    median = statistics.median([math.inf if t is None else t for t in times])
    return None if math.isinf(median) else median


def faster(median: float | None, than: float | None) -> bool:
    """Whether a median time to the level beats another; never reaching it (None) beats nothing."""
    return median is not None and (than is None or median < than)


def mode_report(runs: Sequence[dict[str, Any]], level: float, equal_time: float, window: int) -> dict[str, Any]:
    """One mode's figures over its seeds: per seed, then summarised."""
    times = [time_to_level(r["reward_curve"], r["elapsed_seconds"], level, window) for r in runs]
    at_equal_time = [reward_at(r["reward_curve"], r["elapsed_seconds"], equal_time, window) for r in runs]
    return {
        "seeds": [r["seed"] for r in runs],
        "time_to_level_s": times,
        "time_to_level": summary(times),
        "time_to_level_median_s": median_time(times),
        "reached_level": sum(t is not None for t in times),
        "reward_at_equal_time": at_equal_time,
        "reward_at_equal_time_summary": summary(at_equal_time),
        "final_reward": summary([r["final_reward"] for r in runs]),
        "steps_per_hour": summary([r["steps_per_hour"] for r in runs]),
        "late_rise": summary([late_rise(r["reward_curve"], window=window) for r in runs]),
    }


def compare(
    runs: dict[str, list[dict[str, Any]]], level_fraction: float = LEVEL_FRACTION, window: int = WINDOW
) -> dict[str, Any]:
    """The comparison of the modes' runs (mode -> one run_figures dict per seed, with its `seed`; sync included).

    The equal wall time is the smallest total over all runs: every run has a curve up to it, so none is judged
    past its end."""
    level = level_fraction * statistics.fmean(r["final_reward"] for r in runs["sync"])
    equal_time = min(r["elapsed_seconds"][-1] for mode_runs in runs.values() for r in mode_runs)
    modes = {name: mode_report(mode_runs, level, equal_time, window) for name, mode_runs in runs.items()}
    out: dict[str, Any] = {
        "level_fraction": level_fraction,
        "level": level,
        "window": window,
        "equal_time_s": equal_time,
        "modes": modes,
    }
    asynchronous = [name for name in runs if name != "sync"]
    if not asynchronous:
        return out
    best = max(asynchronous, key=lambda name: modes[name]["steps_per_hour"]["mean"])
    base, fast = modes["sync"], modes[best]
    return out | {
        "best_async_mode": best,
        "speedup": fast["steps_per_hour"]["mean"] / base["steps_per_hour"]["mean"],
        "reward_gap": fast["final_reward"]["mean"] - base["final_reward"]["mean"],
        "reaches_level_faster": faster(fast["time_to_level_median_s"], base["time_to_level_median_s"]),
        "final_reward_within_sync_spread": fast["final_reward"]["mean"] >= base["final_reward"]["min"],
    }


def rounded(value: Any, digits: int = 4) -> Any:
    """The value with every float rounded, for a readable JSON."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def _spread(s: dict[str, Any], form: str) -> str:
    """`mean ± std` of a summary ("-" for what is undefined)."""
    mean = "-" if s["mean"] is None else format(s["mean"], form)
    return mean if s["std"] is None else f"{mean} ± {s['std']:{form}}"


def table(comparison: dict[str, Any]) -> str:
    """The comparison as a few lines of text."""
    c = comparison
    columns = ("mode", "steps/h", "final reward", "[min, max]", "s to level", "reached", "reward at t", "late rise")
    widths = (14, 16, 16, 12, 9, 16, 16)  # of the columns after the mode's
    rows = [columns]
    for name, m in c["modes"].items():
        final, median = m["final_reward"], m["time_to_level_median_s"]
        rows.append(
            (
                name,
                _spread(m["steps_per_hour"], ".0f"),
                _spread(final, ".3f"),
                f"[{final['min']:.3f}, {final['max']:.3f}]",
                "-" if median is None else f"{median:.0f}",
                f"{m['reached_level']}/{len(m['seeds'])}",
                _spread(m["reward_at_equal_time_summary"], ".3f"),
                _spread(m["late_rise"], ".3f"),
            )
        )
    lines = [
        f"level {c['level']:.3f} ({c['level_fraction']} x sync's mean final reward), smoothed over "
        f"{c['window']} steps; equal wall time t = {c['equal_time_s']:.1f} s; s to level: median over seeds",
        *(f"{row[0]:<17}" + "".join(f"{cell:>{w}}" for cell, w in zip(row[1:], widths, strict=True)) for row in rows),
    ]
    if "best_async_mode" in c:
        lines.append(
            f"fastest async mode {c['best_async_mode']}: {c['speedup']:.2f}x sync's steps/h; reaches the level "
            f"faster (median): {c['reaches_level_faster']}; mean final reward not below sync's worst seed: "
            f"{c['final_reward_within_sync_spread']}"
        )
    return "\n".join(lines)


def run_mode(name: str, seed: int, policy: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `userrl train` run of the mode with this seed (in --keep's folder, with every step's rollout dump, or
    in `scratch`); its figures from metrics.jsonl."""
    from tests.support.tiny_run import LEARNING_SETTINGS, tiny_run, train

    delay = [f"gyms.echo.reply_delay_median_s={args.median}", f"gyms.echo.reply_delay_p99_s={args.p99}"]
    out = Path(args.keep) if args.keep else scratch
    run = tiny_run(policy, out, run_name(name, seed), args.steps)
    dumps = ["logging.rollout_dump_every=1", f"logging.rollout_dump_count={DUMP_ALL}"] if args.keep else []
    # LEARNING_SETTINGS pins run.seed and turns the dumps off: the seed's and --keep's overrides come after it
    # (later overrides win).
    overrides = [*run, *LEARNING_SETTINGS, *delay, *MODES[name], *seed_overrides(seed), *dumps]
    started = time.perf_counter()
    records = train(overrides, timeout_s=max(1800, 120 * args.steps))
    seconds = time.perf_counter() - started  # start-up included
    if args.keep:
        shutil.rmtree(out / run_name(name, seed) / "checkpoints", ignore_errors=True)
    return {"seed": seed, **run_figures(records), "run_seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--seeds", type=int, default=0, help="runs per mode, seeds 1..N (default 5, --quick 2)")
    p.add_argument("--seed-list", default="", help="comma-separated seeds (instead of --seeds)")
    p.add_argument("--median", type=float, default=0.2, help="median user reply delay, seconds")
    p.add_argument("--p99", type=float, default=5.0, help="99th percentile of the user reply delay, seconds")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--level-fraction", type=float, default=LEVEL_FRACTION, help="the level: x sync's final reward")
    p.add_argument("--quick", action="store_true", help="12 steps, 2 seeds unless --seeds: a smoke run, not a verdict")
    p.add_argument("--out", default="", help="write the JSON here too")
    p.add_argument("--keep", default="", help="keep every run's directory (with a rollout dump of every step) here")
    args = p.parse_args()
    if args.quick:
        args.steps = 12
    count = args.seeds or (2 if args.quick else 5)
    seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else list(range(1, count + 1))
    if not seeds or len(set(seeds)) < len(seeds):
        raise SystemExit(f"--seed-list: distinct seeds, got {seeds} (a run's name carries its seed)")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes:
        raise SystemExit(f"--modes: {unknown or 'sync is missing'}; choose from {', '.join(MODES)} (sync included)")
    if args.steps < FINAL_STEPS:
        raise SystemExit(f"--steps: at least {FINAL_STEPS} (the final reward is the mean of the last {FINAL_STEPS})")
    if args.keep:
        taken = [run_name(m, s) for s in seeds for m in modes if (Path(args.keep) / run_name(m, s)).exists()]
        if taken:
            raise SystemExit(f"--keep: {args.keep} already holds {', '.join(taken)} (a run there would add to it)")
    from tests.support.tiny_run import learning_policy

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        policy = learning_policy(scratch)
        for seed in seeds:
            for name in modes:
                runs[name].append(run_mode(name, seed, policy, scratch, args))
                print(f"{name} seed {seed}: {json.dumps(rounded(runs[name][-1]))}", flush=True)
    settings = {
        "steps": args.steps,
        "seeds": seeds,
        "reply_delay_median_s": args.median,
        "reply_delay_p99_s": args.p99,
        "overrides": {name: MODES[name] for name in modes},
    }
    comparison = compare(runs, args.level_fraction)
    report = rounded({"settings": settings, "runs": runs, **comparison})
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(table(comparison))


if __name__ == "__main__":
    main()
