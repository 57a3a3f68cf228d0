"""Gym benchmarks. Each benchmark is one function returning a JSON-able dict; the script prints (or writes) one
JSON object keyed by benchmark name. Targets are ratios measured in the same run, so machine speed cancels out.

    python tools/bench_gyms.py                      # every benchmark
    python tools/bench_gyms.py --only tau_fresh_db  # just one
    python tools/bench_gyms.py --out bench.json --data-dir ../shared/data

Benchmarks:
  tau_fresh_db  A fresh tau-bench database per episode: copy-on-write `Domain.new_db()` against `copy.deepcopy` of
                the loaded tables (target >= 20x), and the final-DB hash of a replayed gold episode: incremental
                `EpisodeDB.hash()` against hashing the materialised database, and a whole gold episode (fresh DB,
                tools, final hash) both ways.
"""

import argparse
import copy
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _per_call_s(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean seconds per call of `fn` (called `calls` times per round)."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _retained_bytes(fn: Callable[[], Any]) -> int:
    """Bytes still allocated after `fn` while its result is alive (tracemalloc)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = fn()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del result
    return after - before


def _tau_domain(domain: Any, quick: bool) -> dict[str, Any]:
    from gyms.tau.store import BaseTables, EpisodeDB, db_hash

    domain.base.hash()  # render the base once, as a long-running worker would have
    tasks = [t for t in domain.tasks("test") if t.actions][: 1 if quick else 20]
    rounds = 1 if quick else 3

    def episode(task: Any) -> Any:
        db = domain.new_db()
        domain.replay(task.actions, db)
        return db

    def episode_deepcopy(task: Any) -> str:
        """tau-bench's way: a deep copy per episode, the tools, then the hash of the whole database."""
        db = EpisodeDB(BaseTables(copy.deepcopy(domain.base.tables)))
        domain.replay(task.actions, db)
        return db_hash(db.to_dict())

    def mean_over_tasks(fn: Callable[[Any], Any], rounds: int) -> float:
        return statistics.mean(_per_call_s(lambda t=t: fn(t), calls=1, rounds=rounds) for t in tasks)

    deepcopy_s = _per_call_s(lambda: copy.deepcopy(domain.base.tables), calls=1 if quick else 5, rounds=rounds)
    new_db_s = _per_call_s(domain.new_db, calls=2_000 if quick else 20_000, rounds=rounds)
    episodes = {id(t): episode(t) for t in tasks}
    full_hash_s = mean_over_tasks(lambda t: db_hash(episodes[id(t)].to_dict()), rounds=1)
    hash_s = mean_over_tasks(lambda t: episodes[id(t)].hash(), rounds=rounds)
    episode_deepcopy_s = mean_over_tasks(episode_deepcopy, rounds=1)
    episode_cow_s = mean_over_tasks(lambda t: episode(t).hash(), rounds=rounds)
    return {
        "deepcopy_ms": round(deepcopy_s * 1e3, 3),
        "new_db_us": round(new_db_s * 1e6, 3),
        "fresh_db_speedup": round(deepcopy_s / new_db_s, 1),
        "deepcopy_retained_kb": round(_retained_bytes(lambda: copy.deepcopy(domain.base.tables)) / 1024, 1),
        "episode_retained_kb": round(_retained_bytes(lambda: episode(tasks[0])) / 1024, 1),
        "final_hash_full_ms": round(full_hash_s * 1e3, 3),
        "final_hash_incremental_ms": round(hash_s * 1e3, 3),
        "final_hash_speedup": round(full_hash_s / hash_s, 1),
        "episode_deepcopy_ms": round(episode_deepcopy_s * 1e3, 3),
        "episode_cow_ms": round(episode_cow_s * 1e3, 3),
        "episode_speedup": round(episode_deepcopy_s / episode_cow_s, 1),
        "episodes": len(tasks),
    }


def bench_tau_fresh_db(data_dir: Path, quick: bool = False) -> dict[str, Any]:
    from gyms.tau.domain import load_domain

    out: dict[str, Any] = {
        name: _tau_domain(load_domain(name, str(data_dir / "taubench")), quick) for name in ("retail", "airline")
    }
    out["target_fresh_db_speedup"] = 20.0
    out["meets_target"] = all(out[n]["fresh_db_speedup"] >= 20.0 for n in ("retail", "airline"))
    return out


BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {"tau_fresh_db": bench_tau_fresh_db}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--data-dir", default="", help="public data folder (default: gyms.data_dir resolution)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not a measurement)")
    args = parser.parse_args(argv)

    from gyms.data import data_dir

    root = data_dir(args.data_dir)
    results = {name: BENCHMARKS[name](root, quick=args.quick) for name in args.only or sorted(BENCHMARKS)}
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
