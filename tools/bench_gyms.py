"""Gym benchmarks. Each benchmark is one function from the parsed arguments to a JSON-able dict; the script prints
(or writes) one JSON object keyed by benchmark name. Targets are ratios measured in the same run, so machine speed
cancels out.

    python tools/bench_gyms.py                              # every benchmark
    python tools/bench_gyms.py --only user_sim_concurrency  # just one
    python tools/bench_gyms.py --out bench.json --data-dir ../shared/data

Benchmarks:
  tau_fresh_db  A fresh tau-bench database per episode: copy-on-write `Domain.new_db()` against `copy.deepcopy` of
                the loaded tables (target >= 20x), and the final-DB hash of a replayed gold episode: incremental
                `EpisodeDB.hash()` against hashing the materialised database, and a whole gold episode (fresh DB,
                tools, final hash) both ways.
  user_sim_concurrency
                N episodes of T simulator-backed turns (TelepathyGym questions) against a local OpenAI-compatible
                server (another process) that answers every call after a fixed delay, per HTTP backend and
                `user_sim.max_concurrency`. The ideal wall time is T x delay x ceil(N / max_concurrency); the
                figure of merit is measured / ideal (1.0 is perfect; client CPU and scheduling push it up).
"""

import argparse
import asyncio
import copy
import json
import math
import multiprocessing
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


def bench_tau_fresh_db(args: argparse.Namespace) -> dict[str, Any]:
    from gyms.tau.domain import load_domain

    out: dict[str, Any] = {
        name: _tau_domain(load_domain(name, str(args.data_root / "taubench")), args.quick)
        for name in ("retail", "airline")
    }
    out["target_fresh_db_speedup"] = 20.0
    out["meets_target"] = all(out[n]["fresh_db_speedup"] >= 20.0 for n in ("retail", "airline"))
    return out


ENTITY = {"id": "bench", "title": "Kiwi", "description": "A fruit.", "target_entity": "Kiwi", "category": "food"}


async def _episodes(sim: Any, episodes: int, turns: int) -> list[float]:
    from gyms.base import make_gym

    async def one() -> float:
        gym = make_gym("telepathy", ENTITY, user_sim=sim)
        await gym.reset()
        total = 0.0
        for _ in range(turns):
            result = await gym.step("[action] Is it bigger than a melon?")
            assert result.user_sim_error is None, result.user_sim_error
            total += result.reward
        await gym.close()
        return total

    try:
        return await asyncio.gather(*(one() for _ in range(episodes)))
    finally:
        await sim.close()


def bench_user_sim_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    from gyms.user_sim import UserSimulator
    from tests.support.openai_server import serve_in_process
    from userrl_megatron.config.schema import UserSimConfig

    episodes, turns = (16, 2) if args.quick else (args.episodes, args.turns)
    ctx = multiprocessing.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    answer = '{"thought": "", "response": "No"}'
    server = ctx.Process(target=serve_in_process, args=(answer, args.delay, port_queue, stop), daemon=True)
    server.start()
    try:
        base_url = port_queue.get(timeout=600)  # a spawned interpreter starting its server: only a hang waits this long
        rows = []
        for backend, concurrency in [(b, c) for b in args.backends for c in args.concurrency]:
            cfg = UserSimConfig(
                base_url=base_url,
                api_key_env="none",
                model="bench",
                max_concurrency=concurrency,
                timeout_s=30.0,
                http_backend=backend,
            )
            sim = UserSimulator(cfg)
            asyncio.run(_episodes(sim, 2, 1))  # warm-up: imports and the first connection are one-time costs
            sim.metrics(reset=True)
            start = time.perf_counter()
            asyncio.run(_episodes(sim, episodes, turns))
            wall = time.perf_counter() - start
            ideal = turns * args.delay * math.ceil(episodes / concurrency)
            metrics = sim.metrics()
            rows.append(
                {
                    "episodes": episodes,
                    "turns": turns,
                    "delay_s": args.delay,
                    "max_concurrency": concurrency,
                    "http_backend": backend,
                    "wall_s": round(wall, 3),
                    "ideal_s": round(ideal, 3),
                    "ratio": round(wall / ideal, 3),
                    "calls": metrics["calls"],
                    "failures": metrics["failures"],
                    "retries": metrics["retries"],
                    "latency_mean_s": round(metrics["latency_mean_s"], 4),
                    "in_flight_max": metrics["in_flight_max"],
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        return {"rows": rows}
    finally:
        stop.set()
        server.join(timeout=30)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "tau_fresh_db": bench_tau_fresh_db,
    "user_sim_concurrency": bench_user_sim_concurrency,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.add_argument("--data-dir", default="", help="public data folder (default: gyms.data_dir resolution)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not a measurement)")
    parser.add_argument("--episodes", type=int, default=256, help="user_sim_concurrency: concurrent episodes")
    parser.add_argument("--turns", type=int, default=4, help="user_sim_concurrency: simulator turns per episode")
    parser.add_argument("--delay", type=float, default=0.2, help="user_sim_concurrency: server delay per call (s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 64], help="user_sim.max_concurrency")
    parser.add_argument("--backends", nargs="+", default=["aiohttp", "httpx"], help="user_sim.http_backend values")
    args = parser.parse_args(argv)

    from gyms.data import data_dir

    args.data_root = data_dir(args.data_dir)
    results = {name: BENCHMARKS[name](args) for name in args.only or sorted(BENCHMARKS)}
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
