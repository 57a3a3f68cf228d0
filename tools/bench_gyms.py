"""Gym benchmarks; each writes its figures into one JSON file. Run: `python tools/bench_gyms.py [--only NAME ...]`.

user_sim_concurrency: N episodes of T simulator-backed turns (TelepathyGym questions) against a local
OpenAI-compatible server (another process) that answers every call after a fixed delay. With enough
concurrency the wall time should be close to the ideal T x delay x ceil(N / max_concurrency); the ratio
measured / ideal is the figure of merit (1.0 is perfect; client overhead and scheduling push it up).

Add a benchmark by writing `bench_<name>(args) -> dict` and listing it in BENCHMARKS.
"""

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyms.base import make_gym  # noqa: E402
from gyms.user_sim import UserSimulator  # noqa: E402
from userrl_megatron.config.schema import UserSimConfig  # noqa: E402

ENTITY = {"id": "bench", "title": "Kiwi", "description": "A fruit.", "target_entity": "Kiwi", "category": "food"}


def _serve(delay_s: float, port_queue: Any, stop: Any) -> None:
    """Child process: the test server, answering every call after `delay_s`."""
    from tests.support.openai_server import Answer, OpenAIServer, reply

    with OpenAIServer(reply(Answer('{"thought": "", "response": "No"}', delay_s=delay_s))) as server:
        port_queue.put(server.base_url)
        stop.wait()


async def _episodes(sim: UserSimulator, episodes: int, turns: int) -> list[float]:
    async def one() -> float:
        gym = make_gym("telepathy", ENTITY, user_sim=sim)
        await gym.reset()
        total = 0.0
        for _ in range(turns):
            result = await gym.step("[action] Is it bigger than a melon?")
            assert "user_sim_error" not in result.info, result.info
            total += result.reward
        await gym.close()
        return total

    try:
        return await asyncio.gather(*(one() for _ in range(episodes)))
    finally:
        await sim.close()


def bench_user_sim_concurrency(args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(args.delay, port_queue, stop), daemon=True)
    server.start()
    try:
        base_url = port_queue.get(timeout=60)
        rows = []
        for backend, concurrency in [(b, c) for b in args.backends for c in args.concurrency]:
            cfg = UserSimConfig(
                base_url=base_url, model="bench", max_concurrency=concurrency, timeout_s=30.0, http_backend=backend
            )
            sim = UserSimulator(cfg)
            asyncio.run(_episodes(sim, 2, 1))  # warm-up: imports and the first connection are one-time costs
            sim.metrics(reset=True)
            start = time.perf_counter()
            asyncio.run(_episodes(sim, args.episodes, args.turns))
            wall = time.perf_counter() - start
            ideal = args.turns * args.delay * math.ceil(args.episodes / concurrency)
            metrics = sim.metrics()
            rows.append(
                {
                    "episodes": args.episodes,
                    "turns": args.turns,
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
            print(json.dumps(rows[-1]), flush=True)
        return {"rows": rows}
    finally:
        stop.set()
        server.join(timeout=30)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "user_sim_concurrency": bench_user_sim_concurrency,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="benchmarks to run (default: all)")
    parser.add_argument("--out", default="runs/bench_gyms.json", help="JSON file with every figure")
    parser.add_argument("--episodes", type=int, default=256, help="concurrent episodes")
    parser.add_argument("--turns", type=int, default=4, help="simulator-backed turns per episode")
    parser.add_argument("--delay", type=float, default=0.2, help="server delay per call (s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 64], help="user_sim.max_concurrency")
    parser.add_argument("--backends", nargs="+", default=["aiohttp", "httpx"], help="user_sim.http_backend values")
    args = parser.parse_args()
    results = {"machine": {"cpus": multiprocessing.cpu_count(), "python": sys.version.split()[0]}}
    for name in args.only or list(BENCHMARKS):
        results[name] = BENCHMARKS[name](args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
