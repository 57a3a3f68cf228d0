"""Asynchronous rollout modes against `sync` on heavy-tailed multi-turn episodes, on CPU, in one run.

A tiny Qwen3 policy (character tokenizer, warmed up to answer with a random letter of "abcd") learns EchoGym
(alphabet "a", 3 turns, graded per-turn rewards) through the real `userrl train`: Ray, the Megatron actor, the
embedded engine, weight sync. The simulated user answers each step after a log-normal delay (median 200 ms,
p99 5 s by default: an API model's long tail), so a step's rollout waits for its slowest groups. Modes, same
seeds and settings:

    sync               rollout, train, push
    one_step_off       the next step's rollout runs while this step trains
    one_step_off_os    one_step_off + partial rollouts + over-sampling (train on the first groups to finish
                       with signal; unfinished groups carry over and may lag 2 versions: max_staleness 2)

Reported per mode: steps per hour (from the steps' wall time, `timing/step`), the reward curve
(`rollout/reward_mean` per step), its final mean (last 3 steps); top level: `speedup` (best asynchronous
mode's steps/hour over sync's) and `reward_gap` (that mode's final reward minus sync's).

    python tools/bench_async.py --quick --out bench_async.json    # a few minutes on 2 cores
    python tools/bench_async.py --steps 20 --median 0.2 --p99 5
"""

import argparse
import json
import sys
import tempfile
import time
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


def run_mode(name: str, policy: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `userrl train` run of the mode; its figures from metrics.jsonl."""
    from tests.support.tiny_run import LEARNING_SETTINGS, tiny_run, train

    delay = [f"gyms.echo.reply_delay_median_s={args.median}", f"gyms.echo.reply_delay_p99_s={args.p99}"]
    started = time.perf_counter()
    overrides = [*tiny_run(policy, scratch, name, args.steps), *LEARNING_SETTINGS, *delay, *MODES[name]]
    records = train(overrides, timeout_s=1800)
    wall = time.perf_counter() - started
    step_seconds = sum(r["timing/step"] for r in records)
    rewards = [round(r["rollout/reward_mean"], 4) for r in records]
    out: dict[str, Any] = {
        "overrides": MODES[name],
        "steps": len(records),
        "step_seconds": round(step_seconds, 3),
        "steps_per_hour": round(3600 * len(records) / step_seconds, 1),
        "run_seconds": round(wall, 1),  # start-up included
        "rollout_seconds_mean": round(sum(r["timing/rollout"] for r in records) / len(records), 3),
        "train_seconds_mean": round(sum(r.get("timing/train", 0.0) for r in records) / len(records), 3),
        "reward_curve": rewards,
        "final_reward": round(sum(rewards[-FINAL_STEPS:]) / len(rewards[-FINAL_STEPS:]), 4),
    }
    stale = [r["rollout/staleness_max"] for r in records if "rollout/staleness_max" in r]
    if stale:
        out["staleness_max"] = max(stale)
    for key in ("groups_started", "groups_used", "groups_carried", "groups_dropped"):
        values = [r[f"rollout/{key}"] for r in records if f"rollout/{key}" in r]
        if values:
            out[key] = sum(values) if key != "groups_carried" else values[-1]
    out["stale_groups_dropped"] = sum(r.get("batch/stale_groups", 0.0) for r in records)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="RL steps per mode")
    p.add_argument("--median", type=float, default=0.2, help="median user reply delay, seconds")
    p.add_argument("--p99", type=float, default=5.0, help="99th percentile of the user reply delay, seconds")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--quick", action="store_true", help="12 steps per mode (a few minutes on 2 cores)")
    p.add_argument("--out", default="", help="write the JSON here too")
    args = p.parse_args()
    if args.quick:
        args.steps = 12
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes:
        raise SystemExit(f"--modes: {unknown or 'sync is missing'}; choose from {', '.join(MODES)} (sync included)")
    from tests.support.tiny_run import learning_policy

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        policy = learning_policy(scratch)
        results = {}
        for name in modes:
            results[name] = run_mode(name, policy, scratch, args)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    base = results["sync"]
    best = max((m for m in modes if m != "sync"), key=lambda m: results[m]["steps_per_hour"], default=None)
    report: dict[str, Any] = {
        "settings": {"steps": args.steps, "reply_delay_median_s": args.median, "reply_delay_p99_s": args.p99},
        "modes": results,
    }
    if best is not None:
        report["best_async_mode"] = best
        report["speedup"] = round(results[best]["steps_per_hour"] / base["steps_per_hour"], 3)
        report["reward_gap"] = round(results[best]["final_reward"] - base["final_reward"], 4)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
