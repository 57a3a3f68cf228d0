"""The embedded engine beside SGLang: the same multi-turn load on both servers, one after the other, in one run.

For each thread count (`--threads`) and backend (`--backend embedded sglang`) the script starts the server with the
project's own launcher (`launch_embedded`: `userrl serve`; `launch_sglang`: the real SGLang 0.5.23 of
`.venv-sglang`, `--device cpu`), SmolLM2-135M-Instruct in float32 by default, then for each concurrency c runs
max(c, `--min-episodes`) episodes, c at a time. An episode is `--turns` turns: a turn sends the whole conversation
so far (prompt, earlier outputs, a fixed environment reply), as the multi-turn rollout does, so the prefix cache is
exercised. Turns are sampled (temperature 1, no seed: the rollout's settings) and of fixed length: `ignore_eos`
makes every turn generate exactly `--max-new-tokens` tokens on both servers, so both do the same work (a shorter
turn would be counted in `short_turns`). Each level starts from an empty prefix cache (`/flush_cache`).

Time to first token (TTFT) is measured by streaming: every request is SGLang's native `/generate` with
`stream: true` (both servers speak it) and `sampling_params.stream_interval` = `--max-new-tokens`, so the server
sends the first token at once and then the finished turn (two events a turn, on both servers). TTFT is the time from
sending the request to reading the first event that carries an output token, measured by this client, over every
turn of the level (a later turn's TTFT holds the prefill of what the turns before it added, and the wait behind the
decodes running beside it). Generated tokens/s is the level's generated tokens over its wall time, prefills
included.

Reported per backend, thread count and concurrency: tokens/s, TTFT mean / p50 / p90, the ratio to the first level
(the old target: >= 4x at 32 on 2 CPU cores); per thread count and concurrency, embedded / SGLang for tokens/s
(target: >= 1, the embedded engine never slower) and for TTFT (<= 1 is the embedded engine answering first).
`matmul` is the machine's fp32 matmul rate, measured in this process before any server starts, on the thread count
the servers get (two `--matmul-size` square matrices, `--matmul-count` products in a row, best of 5 such runs, with
torch.mm and with oneDNN's matmul where available: the faster kernel's rate);
each level's `matmul_share` is its decode rate in FLOP/s (2 x the model's matmul parameters per generated token,
counted from its HF config: the tied embedding once, as the LM head; attention's own FLOPs not counted) as a share
of that rate (target: >= 0.7 at concurrency 32). Its `work_share` counts, beside the generated tokens, every prompt
token the server computed (`prompt_tokens - cached_tokens` of each turn, summed in `prefilled_tokens`): the share
of the machine the server used, prefills included. `matmul[].ceiling` is what that share could be at most with these
kernels: the model's own weight matrices (every layer's q, k, v, o, gate, up and down, then the LM head; each its own
tensor, as in the model, so none is still in cache when it is read again) multiplied by 32 rows, best of 5 passes,
per kernel; its `share` is that rate over the machine's (dense models only: a mixture of experts reports none).

    python tools/bench_engine.py --backend embedded sglang --concurrency 1 8 32 128 --out runs/bench_engine_peer.json
    python tools/bench_engine.py --out runs/bench_engine.json  # the embedded engine alone, concurrency 1 and 32
    python tools/bench_engine.py --threads 1 2 --concurrency 32  # one thread (what Ray gave the pool's engines) vs two

`--profile-decode` runs no server: it loads the embedded engine in this process, starts `--concurrency` (the
first level, default 32) requests, waits until all of them decode, times `--profile-steps` decode steps, then
profiles as many with torch.profiler on the scheduler thread and splits a step's time into the forward's matmuls,
attention, other ops and Python, the sampler, and the scheduler's own work (KV-cache bookkeeping, Python):

    python tools/bench_engine.py --profile-decode --concurrency 32 --out runs/profile_decode.json

`--cpu-linear torch` runs the embedded engine's float32 linear layers on torch's own kernel instead of oneDNN's
(`rollout.embedded.cpu_linear`), for an A/B of the two.

`--structured` runs each level a second time on the same server with every turn constrained by a JSON schema the
size of a gym's reply schema (`json_schema`, SGLang's sampling param; the server compiles it once). Those levels
are in `structured_levels`; `structured` gives their tokens/s over the free level's, per backend, thread count and
concurrency (target: >= 0.8). A constrained turn ends when its JSON does (`short_turns` counts those):

    python tools/bench_engine.py --structured --concurrency 1 32 --out runs/bench_engine_structured.json
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FEEDBACK = "\nThe user says: that is not quite right, try again and be more specific.\n"
BACKENDS = ("embedded", "sglang")
MATMUL_TRIALS = 5
SHARE_AT = 32  # the concurrency whose matmul share has the target, and the rows of the ceiling's matmuls
MIN_KV_TOKENS = 16384
# What the JSON keeps of each server's /server_info (the keys it has).
SERVER_KEYS = (
    "cpu_threads", "cpu_linear", "max_running_requests", "max_prefill_tokens", "prefix_cache_tokens",
    "attention_backend", "max_total_num_tokens", "chunked_prefill_size", "sampling_backend", "disable_radix_cache",
    "version",
)  # fmt: skip
TTFT_METHOD = (
    "client-side: from sending POST /generate (stream: true, stream_interval = max_new_tokens) to reading the first "
    "server-sent event that carries an output token; every turn of every episode of the level"
)
STRUCTURED_TARGET = 0.8  # tokens/s with a schema over tokens/s without, at every level
# A gym-sized reply schema (the user simulator's kind): free text, an enum, a bounded number, a boolean, a list.
REPLY_SCHEMA = {
    "type": "object",
    "properties": {
        "reply": {"type": "string", "maxLength": 400},
        "intent": {"type": "string", "enum": ["answer", "clarify", "refuse", "end"]},
        "satisfaction": {"type": "integer", "minimum": 0, "maximum": 10},
        "done": {"type": "boolean"},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
    },
    "required": ["reply", "intent", "satisfaction", "done", "topics"],
}
MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "mkldnn::_linear_pointwise",
)


@dataclass(frozen=True)
class Turn:
    """One streamed request: how many tokens it generated, when the first one arrived, and how many of its prompt's
    tokens the server computed (those its prefix cache did not hold: `prompt_tokens - cached_tokens`)."""

    tokens: int
    ttft_s: float
    prefilled: int


# ---- the figures (pure functions) ----


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) with linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and 90th percentile."""
    return {"mean": sum(values) / len(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9)}


def level_summary(concurrency: int, episodes: int, turns: Sequence[Turn], seconds: float, max_new_tokens: int) -> dict:
    """One level's figures from its turns and wall time."""
    tokens = sum(t.tokens for t in turns)
    return {
        "concurrency": concurrency,
        "episodes": episodes,
        "requests": len(turns),
        "tokens": tokens,
        "prefilled_tokens": sum(t.prefilled for t in turns),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_s": spread([t.ttft_s for t in turns]),
        "short_turns": sum(t.tokens < max_new_tokens for t in turns),
    }


def matmul_rate(size: int, count: int, seconds: float) -> float:
    """FLOP/s of `count` products of two `size` x `size` matrices in `seconds`."""
    return 2.0 * size**3 * count / seconds


def matmul_parameters(num_active_parameters: int, vocab_size: int, hidden_size: int, tied_embeddings: bool) -> int:
    """Parameters a generated token multiplies with: all (a token's share of the experts for MoE) but an untied
    input embedding, which is a lookup (a tied one counts once, as the LM head)."""
    return num_active_parameters - (0 if tied_embeddings else vocab_size * hidden_size)


def matmul_share(tokens_per_s: float, flops_per_token: float, matmul_flops_per_s: float) -> float:
    """Decode FLOP/s as a share of the machine's matmul rate."""
    return tokens_per_s * flops_per_token / matmul_flops_per_s


def linear_shapes(arch: Any) -> list[tuple[int, int]] | None:
    """(out, in) of every weight matrix a decoded token is multiplied with, in the model's order (each layer's q, k,
    v, o, gate, up, down, then the LM head); None for a mixture of experts, whose experts share a row count."""
    if arch.is_moe:
        return None
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)] * arch.num_layers + [(arch.vocab_size, h)]


def kv_tokens(max_concurrency: int, longest_episode: int) -> int:
    """KV-cache tokens each server gets (SGLang's `--max-total-tokens`, the embedded prefix cache): twice what the
    largest level's episodes hold at their end, at least MIN_KV_TOKENS."""
    return max(MIN_KV_TOKENS, 2 * max_concurrency * longest_episode)


def peer_rows(levels: Sequence[dict]) -> list[dict]:
    """Embedded / SGLang per thread count and concurrency, where both ran: tokens/s (>= 1: the embedded engine is
    not slower) and TTFT mean, p50, p90 (<= 1: the embedded engine answers first)."""
    by_key = {(r["backend"], r["threads"], r["concurrency"]): r for r in levels}
    rows = []
    for r in levels:
        if r["backend"] != "embedded" or ("sglang", r["threads"], r["concurrency"]) not in by_key:
            continue
        peer = by_key["sglang", r["threads"], r["concurrency"]]
        ratio = r["tokens_per_s"] / peer["tokens_per_s"]
        ttft = {k: r["ttft_s"][k] / peer["ttft_s"][k] for k in ("mean", "p50", "p90")}
        rows.append(
            {
                "threads": r["threads"],
                "concurrency": r["concurrency"],
                "tokens_per_s_ratio": ratio,
                "ttft_mean_ratio": ttft["mean"],
                "ttft_p50_ratio": ttft["p50"],
                "ttft_p90_ratio": ttft["p90"],
                "embedded_not_slower": ratio >= 1.0,
            }
        )
    return rows


def structured_rows(levels: Sequence[dict], structured: Sequence[dict]) -> list[dict]:
    """Per backend, thread count and concurrency: tokens/s with the schema over tokens/s without (target >= 0.8)."""
    free = {(r["backend"], r["threads"], r["concurrency"]): r for r in levels}
    rows = []
    for r in structured:
        base = free[r["backend"], r["threads"], r["concurrency"]]
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        rows.append(
            {
                "backend": r["backend"],
                "threads": r["threads"],
                "concurrency": r["concurrency"],
                "free_tokens_per_s": base["tokens_per_s"],
                "schema_tokens_per_s": r["tokens_per_s"],
                "tokens_per_s_ratio": ratio,
                "meets_target": ratio >= STRUCTURED_TARGET,
            }
        )
    return rows


def annotate(levels: list[dict], matmul: dict[int, float], flops_per_token: float) -> None:
    """Add each level's matmul share, the share of all the tokens it computed (generated and prefilled), and its
    tokens/s over its server's first level."""
    first: dict[tuple[str, int], float] = {}
    for r in levels:
        base = first.setdefault((r["backend"], r["threads"]), r["tokens_per_s"])
        r["ratio_to_first"] = r["tokens_per_s"] / base
        r["matmul_share"] = matmul_share(r["tokens_per_s"], flops_per_token, matmul[r["threads"]])
        computed_per_s = (r["tokens"] + r["prefilled_tokens"]) / r["seconds"]
        r["work_share"] = matmul_share(computed_per_s, flops_per_token, matmul[r["threads"]])


def targets(levels: Sequence[dict], peers: Sequence[dict], share_at: int = SHARE_AT) -> dict:
    """Whether the embedded engine was never slower than SGLang, and each backend's matmul share at `share_at`."""
    shares: dict[str, dict[str, float]] = {}
    for r in levels:
        if r["concurrency"] == share_at:
            shares.setdefault(r["backend"], {})[str(r["threads"])] = r["matmul_share"]
    return {
        "embedded_never_slower": all(p["embedded_not_slower"] for p in peers) if peers else None,
        "share_target": 0.7,
        "share_at_concurrency": share_at,
        "matmul_share": shares,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["embedded"], help="servers, in order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--min-episodes", type=int, default=4, help="episodes at each level (at least c)")
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="server CPU threads (0: every core)")
    parser.add_argument("--cpu-linear", choices=("onednn", "torch"), default="onednn", help="the embedded engine's")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens every turn generates (ignore_eos)")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--matmul-count", type=int, default=4, help="matmuls timed together, best of 5 runs")
    parser.add_argument("--port", type=int, default=31999)
    parser.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    parser.add_argument("--structured", action="store_true", help="each level again with a JSON schema on every turn")
    parser.add_argument("--profile-decode", action="store_true", help="profile decode steps in-process instead")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_engine.json"))
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.turns < 1 or args.max_new_tokens < 1 or min(args.threads) < 0:
        parser.error("--concurrency, --turns and --max-new-tokens must be >= 1, --threads >= 0")
    return args


# ---- measuring ----


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU thread count set to `threads` inside the block."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def best_seconds(run: Any, trials: int) -> float:
    """The fastest of `trials` calls of `run()`, after one call that warms up."""
    run()
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_kernels() -> dict[str, Any]:
    """The fp32 matmul kernels the embedded engine may run on CPU, as `kernel(a, b)` = a @ b.T."""
    import torch

    from userrl_megatron.server import onednn

    kernels: dict[str, Any] = {"torch.mm": lambda a, b: torch.mm(a, b.t())}
    if onednn.available():
        kernels["onednn"] = onednn.linear
    return kernels


def measure_matmul(threads: int, size: int, count: int, trials: int = MATMUL_TRIALS) -> dict:
    """The best of `trials` runs of `count` fp32 `size` x `size` matmuls on `threads` torch threads, for each CPU
    kernel the engine may use (torch's `mm`; oneDNN's, where available); the machine's rate is the faster one."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    with torch_threads(threads):
        rates = {
            name: matmul_rate(size, count, best_seconds(lambda k=kernel: [k(a, b) for _ in range(count)], trials))
            for name, kernel in cpu_kernels().items()
        }
    return {"threads": threads, "size": size, "count": count, "kernels_flops_per_s": rates,
            "flops_per_s": max(rates.values())}  # fmt: skip


def measure_ceiling(shapes: list[tuple[int, int]], rows: int, threads: int, trials: int = MATMUL_TRIALS) -> dict:
    """The best of `trials` passes of `rows` rows through fp32 weight matrices of `shapes` on `threads` threads, for
    each kernel: the FLOP/s of a decode step that would be nothing but its matmuls."""
    import torch

    weights = [torch.randn(out, inp) for out, inp in shapes]
    inputs = {inp: torch.randn(rows, inp) for inp in {inp for _, inp in shapes}}
    with torch_threads(threads):
        seconds = {
            name: best_seconds(lambda k=kernel: [k(inputs[w.shape[1]], w) for w in weights], trials)
            for name, kernel in cpu_kernels().items()
        }
    flops = 2.0 * rows * sum(out * inp for out, inp in shapes)
    return {"rows": rows, "kernels_seconds": seconds, "flops_per_s": flops / min(seconds.values())}


async def stream_turn(
    session: Any, url: str, input_ids: list[int], max_new_tokens: int, constraint: dict[str, Any] | None = None
) -> tuple[list[int], Turn]:
    """One streamed `/generate` of exactly `max_new_tokens` sampled tokens (fewer when `constraint`, a grammar
    sampling param, ends first): (output ids, the turn's figures)."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                "stream_interval": max_new_tokens, **(constraint or {})}  # fmt: skip
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] | None = None
    async with session.post(url + "/generate", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}/generate: HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            last = json.loads(line[len(b"data: ") :])
            if first is None and last["output_ids"]:
                first = time.perf_counter() - start
    if last is None or first is None:
        raise RuntimeError(f"{url}/generate: the stream ended without a token")
    reason = (last["meta_info"].get("finish_reason") or {}).get("type")
    if reason not in ("length", "stop"):
        raise RuntimeError(f"{url}/generate ended with {last['meta_info'].get('finish_reason')}")
    meta = last["meta_info"]
    return list(last["output_ids"]), Turn(len(last["output_ids"]), first, meta["prompt_tokens"] - meta["cached_tokens"])


async def episode(
    session: Any,
    url: str,
    prompt: list[int],
    feedback: list[int],
    turns: int,
    max_new: int,
    constraint: dict[str, Any] | None = None,
) -> list:
    """`turns` turns, each resending the conversation so far plus the environment's reply."""
    ids, done = list(prompt), []
    for _ in range(turns):
        output, turn = await stream_turn(session, url, ids, max_new, constraint)
        done.append(turn)
        ids = ids + output + feedback
    return done


async def run_level(
    session: Any,
    url: str,
    prompts: list[list[int]],
    feedback: list[int],
    concurrency: int,
    args: argparse.Namespace,
    constraint: dict[str, Any] | None = None,
) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> list[Turn]:
        async with gate:
            return await episode(session, url, prompt, feedback, args.turns, args.max_new_tokens, constraint)

    start = time.perf_counter()
    episodes = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    return level_summary(concurrency, len(prompts), [t for e in episodes for t in e], seconds, args.max_new_tokens)


@contextlib.contextmanager
def sglang_cores(threads: int) -> Iterator[str]:
    """SGLang's CPU thread binding for `threads` (0: the launcher's own, every usable core): the first `threads`
    usable cores, in `SGLANG_CPU_OMP_THREADS_BIND` while the server starts (`sglang_env` keeps a set one)."""
    from userrl_megatron.cores import cpu_list, usable_cores
    from userrl_megatron.fleet.sglang import OMP_BIND_ENV

    if not threads:
        yield os.environ.get(OMP_BIND_ENV, cpu_list(usable_cores()))
        return
    previous = os.environ.get(OMP_BIND_ENV)
    os.environ[OMP_BIND_ENV] = cpu_list(usable_cores()[:threads])
    try:
        yield os.environ[OMP_BIND_ENV]
    finally:
        if previous is None:
            del os.environ[OMP_BIND_ENV]
        else:
            os.environ[OMP_BIND_ENV] = previous


def start_server(backend: str, path: str, threads: int, kv: int, args: argparse.Namespace) -> tuple[Any, dict]:
    """Launch one server with the project's launcher; (the server, what the JSON records of its launch)."""
    from userrl_megatron.config.schema import EmbeddedServerConfig, SGLangConfig
    from userrl_megatron.fleet.launch import launch_embedded
    from userrl_megatron.fleet.sglang import launch_sglang

    running = max(args.concurrency)
    log = args.out.parent / f"{args.out.stem}-{backend}-t{threads}.log"
    if backend == "embedded":
        cfg = EmbeddedServerConfig(
            device="cpu", max_running_requests=running, threads=threads, prefix_cache_tokens=kv,
            startup_timeout_s=args.startup_timeout, cpu_linear=args.cpu_linear,
        )  # fmt: skip
        return launch_embedded(path, cfg, args.port, "float32", log_path=log), {"log": str(log)}
    sglang = SGLangConfig(
        max_total_tokens=kv, startup_timeout_s=args.startup_timeout,
        extra_args=["--max-running-requests", str(running)],
    )  # fmt: skip
    with sglang_cores(threads) as cores:
        server = launch_sglang(sglang, path, 1, args.port, "float32", log_path=log, device="cpu")
    return server, {"log": str(log), "cores": cores}


async def server_info(session: Any, url: str) -> dict:
    async with session.get(url + "/server_info") as response:
        info = await response.json(content_type=None) if response.status == 200 else {}
    return {k: info[k] for k in SERVER_KEYS if k in info}


async def bench_server(
    backend: str,
    threads: int,
    path: str,
    prompts: list[list[int]],
    feedback: list[int],
    kv: int,
    args: argparse.Namespace,
) -> tuple[list[dict], dict]:
    """Every level on one server (with `--structured`, each also constrained, in `launch["structured_levels"]`);
    (the levels, the server's settings)."""
    import aiohttp

    from userrl_megatron.fleet.engine import SGLangClient

    started = time.perf_counter()
    server, launch = start_server(backend, path, threads, kv, args)
    launch["startup_seconds"] = time.perf_counter() - started
    levels = []
    try:
        connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: every episode of a level streams at once
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            launch["server_info"] = await server_info(session, server.url)
            async with SGLangClient(server.url) as control:
                await run_level(session, server.url, prompts[:1], feedback, 1, args)  # warm-up
                for c in args.concurrency:
                    await control.flush_cache(timeout_s=60)
                    level = await run_level(
                        session, server.url, prompts[: max(c, args.min_episodes)], feedback, c, args
                    )
                    levels.append({"backend": backend, "threads": threads} | level)
                    print(json.dumps(levels[-1]), flush=True)
                    if args.structured:
                        await control.flush_cache(timeout_s=60)
                        schema = {"json_schema": json.dumps(REPLY_SCHEMA)}
                        level = await run_level(
                            session, server.url, prompts[: max(c, args.min_episodes)], feedback, c, args, schema
                        )
                        structured = {"backend": backend, "threads": threads, "constraint": "json_schema"} | level
                        launch.setdefault("structured_levels", []).append(structured)
                        print(json.dumps(structured), flush=True)
    finally:
        server.stop()
    return levels, launch


async def main(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from userrl_megatron.convert.arch import Architecture
    from userrl_megatron.model_store import resolve_model

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    arch = Architecture.from_hf_dir(path)
    params = matmul_parameters(arch.num_active_parameters, arch.vocab_size, arch.hidden_size, arch.tied_embeddings)
    flops_per_token = 2.0 * params
    count = max(max(args.concurrency), args.min_episodes)
    prompts = [encode_question(tokenizer, i) for i in range(count)]
    feedback = tokenizer.encode(FEEDBACK, add_special_tokens=False)
    longest = max(len(p) for p in prompts) + args.turns * (args.max_new_tokens + len(feedback))
    kv = kv_tokens(max(args.concurrency), longest)
    default_threads = torch.get_num_threads()  # what a server given 0 threads runs on (torch's default)
    matmul = [measure_matmul(t or default_threads, args.matmul_size, args.matmul_count) for t in args.threads]
    shapes = linear_shapes(arch)
    for t, m in zip(args.threads, matmul, strict=True):
        if shapes is not None:
            ceiling = measure_ceiling(shapes, SHARE_AT, t or default_threads)
            m["ceiling"] = ceiling | {"share": ceiling["flops_per_s"] / m["flops_per_s"]}
        print(json.dumps({"matmul": m, "for_threads": t}), flush=True)
    levels, servers, structured = [], [], []
    for threads in args.threads:  # one server per backend and thread count (0: every core)
        for backend in args.backend:
            done, launch = await bench_server(backend, threads, path, prompts, feedback, kv, args)
            levels += done
            structured += launch.pop("structured_levels", [])
            servers.append({"backend": backend, "threads": threads} | launch)
    annotate(levels, {t: m["flops_per_s"] for t, m in zip(args.threads, matmul, strict=True)}, flops_per_token)
    peers = peer_rows(levels)
    return {
        "benchmark": "engine_peer",
        "model": args.model,
        "parameters": arch.num_parameters,
        "matmul_parameters": params,
        "flops_per_token": flops_per_token,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "min_episodes": args.min_episodes,
        "sampling": {"temperature": 1.0, "ignore_eos": True, "seeded": False, "return_logprob": True},
        "kv_tokens": kv,
        "ttft_method": TTFT_METHOD,
        "matmul": [{"for_threads": t} | m for t, m in zip(args.threads, matmul, strict=True)],
        "servers": servers,
        "levels": levels,
        "peer": peers,
        "targets": targets(levels, peers),
        **({"structured_levels": structured, "structured": structured_rows(levels, structured)} if structured else {}),
    }


def encode_question(tokenizer: Any, i: int) -> list[int]:
    """Episode i's first prompt: a question in the model's chat template."""
    question = f"Question {i}: explain why the sky looks blue in {i % 7 + 2} sentences."
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# ---- --profile-decode ----


def step_breakdown(events: Sequence[Any], steps: int) -> dict[str, float]:
    """Milliseconds a decode step spends where, from the profiler's event tree: each event's self time goes to the
    phase of its nearest labelled ancestor (`decode/forward`, `decode/sample`, else `decode/step`) and, in the
    forward, to matmuls, attention or other ops by the op's name; a label's own self time is Python."""
    totals: dict[str, float] = {}

    def visit(event: Any, phase: str) -> None:
        name = event.name
        if name in ("decode/forward", "decode/sample", "decode/step"):
            phase = name.removeprefix("decode/")
            key = f"{phase}/python"
        elif phase == "forward" and name in MATMUL_OPS:
            key = "forward/matmul"
        elif phase == "forward" and ("scaled_dot_product" in name or "attention" in name):
            key = "forward/attention"
        else:
            key = f"{phase}/ops"
        totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total / 1000.0 / steps
        for child in event.cpu_children:
            visit(child, phase)

    for event in events:
        if event.name == "decode/step" and event.cpu_parent is None:
            visit(event, "step")
    return dict(sorted(totals.items()))


def profile_decode(args: argparse.Namespace) -> dict:
    """Where a decode step's time goes at `args.concurrency[0]` running requests (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    import userrl_megatron.server.scheduler as scheduler_module
    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.model_store import resolve_model
    from userrl_megatron.server.local import LocalEngine
    from userrl_megatron.server.sampling import parse_sampling_params
    from userrl_megatron.server.scheduler import Request

    rows, steps, threads = args.concurrency[0], args.profile_steps, args.threads[0]
    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if threads:
        torch.set_num_threads(threads)  # as `userrl serve --threads`
    cfg = EmbeddedServerConfig(device="cpu", max_running_requests=rows, cpu_linear=args.cpu_linear)
    engine = LocalEngine.launch(path, cfg, "float32")
    scheduler = engine.core.scheduler

    def labelled(label: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*a, **k)

        return call

    # Labels for the profiler, in this process only: the step, the model's forward and the batched sampler.
    setattr(scheduler, "_decode", labelled("decode/step", scheduler._decode))  # noqa: B010
    setattr(scheduler.model, "forward", labelled("decode/forward", scheduler.model.forward))  # noqa: B010
    setattr(scheduler_module, "sample", labelled("decode/sample", scheduler_module.sample))  # noqa: B010
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def mark(action: Any = None) -> tuple[int, float]:  # on the scheduler thread, between two steps
        if action is not None:
            action()
        return scheduler.decode_steps, time.perf_counter()

    async def window(start: Any = None, stop: Any = None) -> tuple[int, float]:
        """(decode steps, seconds) of `steps` steps, marked on the scheduler thread."""
        first = await asyncio.wrap_future(scheduler.call(lambda: mark(start)))
        target = first[0] + steps
        while scheduler.decode_steps < target:
            await asyncio.sleep(0.005)
        last = await asyncio.wrap_future(scheduler.call(lambda: mark(stop)))
        return last[0] - first[0], last[1] - first[1]

    async def drive() -> tuple[tuple[int, float], tuple[int, float]]:
        spec = parse_sampling_params(
            {"max_new_tokens": 3 * steps + 64, "temperature": 1.0, "ignore_eos": True}, scheduler.model.spec.vocab_size
        )
        requests = [Request(encode_question(tokenizer, i), spec) for i in range(rows)]
        tasks = [asyncio.ensure_future(engine.core.generate(r)) for r in requests]
        while scheduler.counts() != (rows, 0) or scheduler.decode_steps < 2:  # every request past its prefill
            await asyncio.sleep(0.005)
        plain = await window()
        profiled = await window(profiler.start, profiler.stop)
        engine.core.abort_request(abort_all=True)
        await asyncio.gather(*tasks)
        return plain, profiled

    try:
        (plain_steps, plain_s), (profiled, wall) = asyncio.run(drive())
    finally:
        engine.close()
    breakdown = step_breakdown(profiler.events(), profiled)
    step_ms = sum(breakdown.values())
    ops = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "benchmark": "engine_decode_profile",
        "model": args.model,
        "rows": rows,
        "threads": torch.get_num_threads(),
        "cpu_linear": engine.core.model.cpu_linear,
        "steps_profiled": profiled,
        "step_ms_unprofiled": plain_s * 1000.0 / plain_steps,
        "step_ms_profiled": wall * 1000.0 / profiled,  # the scheduler loop's wall time a step, profiler on
        "breakdown_total_ms": step_ms,  # inside the decode step (the loop's own work between steps is outside)
        "breakdown_ms": breakdown,
        "breakdown_share": {k: v / step_ms for k, v in breakdown.items()},  # of the decode step
        "top_ops_ms_per_step": [
            {"name": e.key, "self_ms": e.self_cpu_time_total / 1000.0 / profiled, "calls": e.count / profiled}
            for e in ops
        ],
    }


if __name__ == "__main__":
    arguments = parse_args()
    report = profile_decode(arguments) if arguments.profile_decode else asyncio.run(main(arguments))
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
