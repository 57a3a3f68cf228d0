"""Embedded engine throughput: generated tokens/s at several concurrencies, over HTTP, in one run.

Launches `userrl serve` (SmolLM2-135M-Instruct by default), then for each concurrency c runs c episodes at once,
each `--turns` turns long: a turn sends the whole conversation so far (prompt, earlier outputs, a fixed
environment reply), as the multi-turn rollout does, so the prefix cache is exercised. Writes JSON with tokens/s
per concurrency (and thread count) and the ratio to the first level (the target: >= 4x at 32 on 2 CPU cores).

    python tools/bench_engine.py --out runs/bench_engine.json
    python tools/bench_engine.py --threads 1 2 --concurrency 32  # one thread (what Ray gave the pool's engines) vs two
"""

import argparse
import asyncio
import json
import time
from pathlib import Path

FEEDBACK = "\nThe user says: that is not quite right, try again and be more specific.\n"


async def episode(client, tokenizer, question: str, turns: int, max_new_tokens: int, seed: int) -> int:
    from userrl_megatron.types import SamplingParams

    messages = [{"role": "user", "content": question}]
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    feedback = tokenizer.encode(FEEDBACK, add_special_tokens=False)
    generated = 0
    for turn in range(turns):
        gen = await client.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, seed=seed * 100 + turn))
        generated += len(gen.output_ids)
        ids = ids + gen.output_ids + feedback
    return generated


async def level(client, tokenizer, concurrency: int, episodes: int, args: argparse.Namespace) -> dict:
    questions = [f"Question {i}: explain why the sky looks blue in {i % 7 + 2} sentences." for i in range(episodes)]
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with gate:
            return await episode(client, tokenizer, questions[i], args.turns, args.max_new_tokens, i)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(run(i) for i in range(episodes))))
    seconds = time.perf_counter() - start
    return {"concurrency": concurrency, "episodes": episodes, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}  # fmt: skip


async def main(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.fleet.engine import SGLangClient
    from userrl_megatron.fleet.launch import launch_embedded
    from userrl_megatron.model_store import resolve_model

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    results = []
    for threads in args.threads:  # one server per thread count (0: torch's default, every core)
        cfg = EmbeddedServerConfig(device="cpu", max_running_requests=max(args.concurrency), threads=threads)
        server = launch_embedded(path, cfg, args.port)
        try:
            async with SGLangClient(server.url, timeout_s=3600) as client:
                await level(client, tokenizer, 1, 1, args)  # warm-up
                for c in args.concurrency:
                    results.append(
                        {"threads": threads} | await level(client, tokenizer, c, max(c, args.min_episodes), args)
                    )
                    print(json.dumps(results[-1]))
        finally:
            server.stop()
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base
    return {"benchmark": "engine_throughput", "model": args.model, "turns": args.turns,
            "max_new_tokens": args.max_new_tokens, "levels": results}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--min-episodes", type=int, default=4, help="episodes at each level (at least c)")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="engine CPU threads (0: all cores)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=31999)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_engine.json"))
    arguments = parser.parse_args()
    report = asyncio.run(main(arguments))
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
