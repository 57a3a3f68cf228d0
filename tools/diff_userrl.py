"""Differential run of this project's gyms against UserRL's own gym code (SalesforceAIResearch/UserRL).

    python tools/diff_userrl.py --userrl /tmp/userrl [--data-dir ../shared/data] [--cases 40] [--seed 0]
                                [--gyms function,turtle,...] [--out diff_userrl.jsonl]

UserRL's environment classes are imported from the checkout (`<userrl>/gyms/<Name>Gym`, configured as UserRL's
`verl/tools/env_manager.py` configures them for training) and driven through `step_async`, the path its
InteractTool uses. Their LLM clients (`OpenAI` / `AsyncOpenAI` in each gym's prompt module) are replaced by a
scripted client, and the Serper connection of SearchGym by a scripted one; this project's gyms get the same
scripted replies through a stand-in for `gyms.user_sim.UserSimulator` (the `chat` coroutine) and a stand-in for the
web search request. PersuadeGym's statements and TravelGym's scenario files are not public: UserRL's lookups of
them are fed this project's record and generated scenario (in the task layout UserRL's loader builds). IntentionGym's
scripted judge replies carry both sides' fields (UserRL's `covered_detail_indices` from 0, this project's
`covered_detail_numbers` from 1). Every case plays one task with one random action sequence (valid and wrong
answers, empty and invalid tags, case and whitespace variants of tags, `[finish]`, repeats, the step limit) and per
step scripted simulator replies (valid, fenced, padded, Python-literal, wrapped in prose, malformed, failing; a
failure fails every retry UserRL makes), the same on both sides. Per step it compares the observation text, the
reward (to 1e-9) and the ending (done or truncated; the split between the two flags separately), and stops a case
at the first step after which the two sides' states may differ (a difference, or in TravelGym a failed simulator
call).

Each difference is classified as documented (a row of gyms/README.md's difference table, by the predicates in
`DOCUMENTED`, tools/userrl_diff/documented.py) or undocumented, written as one JSON line to `--out`, and counted in
the printed table. Exit status 1 when any difference is undocumented. gymnasium is stubbed when it is not
installed (UserRL's envs only build their spaces with it).
"""

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# userrl_diff is in tools/, this script's folder, which Python puts on the path first
from userrl_diff.documented import Diff, classify
from userrl_diff.harness import SCRIPT, Outcome, import_userrl, our_step, stub_gymnasium, userrl_step
from userrl_diff.steppers import SPLITS, STEPPERS, USERRL_ATTEMPTS, build_case, install_search_fakes

# --------------------------------------------------------------------------------------------------------------
# Running


def compare(u: Outcome, o: Outcome) -> list[tuple[str, Any, Any]]:
    found: list[tuple[str, Any, Any]] = []
    if u.error or o.error:
        found.append(("error", u.error, o.error))
        return found
    if u.feedback != o.feedback:
        found.append(("observation", u.feedback, o.feedback))
    if abs(u.reward - o.reward) > 1e-9:
        found.append(("reward", u.reward, o.reward))
    if u.ended != o.ended:
        found.append(("ending", [u.done, u.truncated], [o.done, o.truncated]))
    elif (u.done, u.truncated) != (o.done, o.truncated):
        found.append(("flags", [u.done, u.truncated], [o.done, o.truncated]))
    return found


async def run_case(gym: str, index: int, task: Any, userrl: Any, rng: random.Random, stats: dict[str, Any],
                   diffs: list[Diff]) -> None:  # fmt: skip
    max_steps = rng.choice([3, 5, 8, 12, 20])
    case = build_case(gym, task, max_steps, userrl)
    obs, _ = case.userrl_env.reset()
    first = await case.ours.reset()
    stats["cases"] += 1
    if obs.get("feedback") != first:
        d = Diff(gym, index, task.task_id, 0, "observation", "<reset>", obs.get("feedback"), first, [], [])
        diffs.append(d)
    for step in range(1, max_steps + 2):
        action, replies, notes = STEPPERS[gym](rng, case)
        SCRIPT.set(replies, USERRL_ATTEMPTS.get(gym, 1))
        u = await userrl_step(case.userrl_env, action)
        SCRIPT.set(replies)
        o = await our_step(case.ours, action)
        stats["steps"] += 1
        if SCRIPT.unscripted["userrl"] or SCRIPT.unscripted["ours"]:
            notes.add("unscripted_call")
        found = compare(u, o)
        for kind, uv, ov in found:
            d = Diff(gym, index, task.task_id, step, kind, action, uv, ov, sorted(notes), replies)
            d.documented = classify(d, u, o)
            diffs.append(d)
        # After a difference the two states may differ, and in TravelGym after a failed simulator call too (this
        # project leaves its state as it was, UserRL counts the utterance toward its proactive elicitation): the
        # case stops.
        if found or u.ended or o.ended or (o.sim_error and gym == "travel"):
            break


def summary(stats: dict[str, dict[str, Any]], diffs: list[Diff]) -> str:
    kinds = ["observation", "reward", "ending", "flags", "error"]
    head = f"{'gym':<10} {'cases':>6} {'steps':>6} " + " ".join(f"{k:>12}" for k in kinds)
    head += f" {'documented':>11} {'undocumented':>13}"
    lines = [head, "-" * len(head)]
    for gym, s in stats.items():
        mine = [d for d in diffs if d.gym == gym]
        counts = collections.Counter(d.kind for d in mine)
        undoc = sum(1 for d in mine if not d.documented)
        row = f"{gym:<10} {s['cases']:>6} {s['steps']:>6} " + " ".join(f"{counts[k]:>12}" for k in kinds)
        lines.append(row + f" {len(mine) - undoc:>11} {undoc:>13}")
    rows = collections.Counter(d.documented for d in diffs if d.documented)
    if rows:
        lines.append("")
        lines.append("documented differences by README row:")
        lines += [f"  {n:>6}  {row}" for row, n in rows.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--userrl", type=Path, required=True, help="a UserRL checkout (its gyms/ folder)")
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default: gyms.data_dir())")
    parser.add_argument("--gyms", default=",".join(STEPPERS), help="comma-separated gyms")
    parser.add_argument("--cases", type=int, default=40, help="cases (task + action sequence) per gym")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("diff_userrl.jsonl"), help="JSON lines, one per difference")
    args = parser.parse_args(argv)

    from gyms.data import data_dir as default_data_dir
    from userrl_megatron.config.schema import GymsConfig
    from userrl_megatron.data import load_tasks

    data_dir = args.data_dir or default_data_dir()
    stub_gymnasium()
    stats: dict[str, dict[str, Any]] = {}
    diffs: list[Diff] = []
    wanted = args.gyms.split(",")
    unknown = [g for g in wanted if g not in STEPPERS]
    if unknown:
        raise SystemExit(f"not covered: {', '.join(unknown)}; covered gyms: {', '.join(STEPPERS)}")
    for gym in wanted:
        userrl = import_userrl(args.userrl, gym, data_dir)
        if gym == "search":
            install_search_fakes()
        gcfg = GymsConfig(data_dir=str(data_dir))
        tasks = [t for split in SPLITS.get(gym, ("train", "test")) for t in load_tasks([gym], split, gcfg)]
        rng = random.Random(f"{args.seed}:{gym}")
        stats[gym] = {"cases": 0, "steps": 0}
        for index in range(args.cases):
            task = tasks[index % len(tasks)] if index < len(tasks) else rng.choice(tasks)
            asyncio.run(run_case(gym, index, task, userrl, random.Random(f"{args.seed}:{gym}:{index}"), stats[gym],
                                 diffs))  # fmt: skip
    with args.out.open("w", encoding="utf-8") as f:
        for d in diffs:
            f.write(json.dumps(dataclasses.asdict(d), ensure_ascii=False) + "\n")
    print(summary(stats, diffs))
    print(f"\n{len(diffs)} differences written to {args.out}")
    return 1 if any(not d.documented for d in diffs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
