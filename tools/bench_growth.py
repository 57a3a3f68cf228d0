"""How cost grows with the size of the work: one table per path, from the project's own benchmarks, in one run.

- rollout: `bench_engine.py` (embedded engine, SmolLM2-135M fp32, multi-turn episodes) at concurrency
  `--concurrency` (default 1, 4, 16, 64, 256): generated tokens/s and the time to first token;
- weight sync: `bench_sync.py` (trainer -> one embedded engine over the broadcast path) on random Qwen3 models of
  `--sync-sizes` (hidden:layers, default three sizes from 0.05B to 0.4B parameters; bench_sync's
  heads are hidden / 64 and its KV heads a third of them, which must divide the heads): seconds and the raw gloo
  broadcast of the same bytes;
- training: `bench_train.py` (the Megatron actor's `train_step` on `synthetic-10m`) at `--train-episodes` episodes of
  256 tokens a step (default 2, 4, 8, 16): seconds a step.

Each table lists the cost at every size and the growth exponent between neighbouring sizes: cost ~ size^k, so
k = 1 is linear (twice the work, twice the time), k < 1 is work absorbed by batching and k > 1 grows faster than
the work. The JSON (`--out`) holds the tables and every benchmark's own report; `--markdown` prints the tables.

    python tools/bench_growth.py --out runs/bench_growth.json --markdown
    python tools/bench_growth.py --only train --train-episodes 1 2 --out /tmp/growth.json   # a quick check
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PATHS = ("rollout", "sync", "train")


def exponents(sizes: Sequence[float], costs: Sequence[float]) -> list[float | None]:
    """k between each row and the one before it (cost ratio = size ratio ** k); None for the first row."""
    if len(sizes) != len(costs):
        raise ValueError(f"{len(sizes)} sizes but {len(costs)} costs")
    return [None] + [
        math.log(costs[i] / costs[i - 1]) / math.log(sizes[i] / sizes[i - 1]) for i in range(1, len(sizes))
    ]


def table(rows: list[dict[str, Any]], size: str, cost: str) -> list[dict[str, Any]]:
    """`rows` with `growth_k`: the exponent of `cost` against `size` from the row before."""
    ks = exponents([r[size] for r in rows], [r[cost] for r in rows])
    return [{**r, "growth_k": k} for r, k in zip(rows, ks, strict=True)]


def run_tool(script: str, args: list[str], out: Path) -> dict[str, Any]:
    """Run tools/`script` with `args` writing its JSON to `out`; its report."""
    command = [sys.executable, str(REPO / "tools" / script), *args, "--out", str(out)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def rollout_table(concurrency: list[int], scratch: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    levels = [str(c) for c in concurrency]
    report = run_tool("bench_engine.py", ["--concurrency", *levels], scratch / "engine.json")
    rows = [
        {"concurrency": lv["concurrency"], "tokens": lv["tokens"], "seconds": lv["seconds"],
         "tokens_per_s": lv["tokens_per_s"], "ttft_p50_s": lv["ttft_s"]["p50"]}
        for lv in report["levels"]
    ]  # fmt: skip
    return table(rows, "concurrency", "tokens_per_s"), report


def sync_table(sizes: list[str], tp: int, scratch: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, reports = [], []
    for spec in sizes:
        hidden, layers = spec.split(":")
        report = run_tool(
            "bench_sync.py",
            ["--hidden", hidden, "--layers", layers, "--tp", str(tp), "--repeats", "3"],
            scratch / f"sync_{hidden}_{layers}.json",
        )
        reports.append(report)
        rows.append({
            "hidden": int(hidden), "layers": int(layers), "bytes": report["ours"]["bytes"],
            "seconds": report["ours"]["seconds"], "raw_seconds": report["raw_gloo_broadcast"]["seconds"],
            "ratio": report["ratio"],
        })  # fmt: skip
    return table(rows, "bytes", "seconds"), reports


def train_table(episodes: list[int], scratch: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, reports = [], []
    for n in episodes:
        report = run_tool(
            "bench_train.py",
            ["--model", "synthetic-10m", "--episodes", str(n), "--seq-len", "256", "--steps", "3"],
            scratch / f"train_{n}.json",
        )
        reports.append(report)
        rows.append({"episodes": n, "tokens": report["tokens_per_step"], "step_time_s": report["step_time_s"],
                     "tokens_per_s": report["tokens_per_s"]})  # fmt: skip
    return table(rows, "tokens", "step_time_s"), reports


def markdown(tables: dict[str, list[dict[str, Any]]]) -> str:
    """One Markdown table per path (the columns are each row's keys)."""
    parts = []
    for name, rows in tables.items():
        keys = list(rows[0])
        lines = [f"{name}:", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for row in rows:
            lines.append("| " + " | ".join(_cell(row[k]) for k in keys) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--sync-sizes", nargs="+", default=["512:6", "768:12", "1536:12"], help="hidden:layers")
    p.add_argument("--sync-tp", type=int, default=1)
    p.add_argument("--train-episodes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--out", type=Path, default=Path("runs/bench_growth.json"))
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = p.parse_args(argv)
    tables: dict[str, list[dict[str, Any]]] = {}
    reports: dict[str, Any] = {}
    measure = {
        "rollout": lambda scratch: rollout_table(args.concurrency, scratch),
        "sync": lambda scratch: sync_table(args.sync_sizes, args.sync_tp, scratch),
        "train": lambda scratch: train_table(args.train_episodes, scratch),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in [p for p in PATHS if p in args.only]:
            tables[path], reports[path] = measure[path](Path(tmp))
            # written after each path: a later failure keeps the tables measured so far
            args.out.write_text(json.dumps({"tables": tables, "reports": reports}, indent=2) + "\n")
    print(json.dumps(tables, indent=2))
    if args.markdown:
        print(markdown(tables))


if __name__ == "__main__":
    main()
