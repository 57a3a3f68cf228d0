"""Weight-sync throughput: the trainer's full path against a raw gloo broadcast of the same bytes, in one run.

The model (a random Qwen3 of about 125M parameters by default, fp32) is trained by a TP=2 Megatron actor on
two Ray workers; one embedded engine serves it. Each sync walks the real path: pause, TP gather to the stage
source, HF conversion, 512 MB flat buckets, `update_weights_from_distributed` over HTTP while the bucket is
broadcast over gloo, load into the engine, flush, resume. The baseline broadcasts one flat buffer of the same
number of bytes between two fresh processes over gloo. Reported: GB/s of each, ratio = raw time / ours, and
where the sending thread's time went (medians): `export` (TP gathers), `pack` (each HF tensor written into its
bucket), `broadcast` (waiting for the previous bucket's broadcast: the wire not hidden behind the export),
`engine_load` (waiting for the engines' replies after it), `other` (the rest: session calls), also as one line on
stderr.

`--method both` also times the colocated transport (`sync.method=tensor`: each bucket handed to the engine as a
shared-memory handle through `update_weights_from_tensor`) on the same model and placement, in a second start of
the components; reported as `tensor` with `tensor_vs_distributed` = distributed seconds / tensor seconds.
`--compare-packed` also times the broadcast with `sync.direct=false` (every tensor copied into a flat bucket, none
broadcast from its own memory), reported as `packed` with `direct_vs_packed` = packed seconds / direct seconds.
`--model` takes an HF directory or an embedded model name (e.g. smollm2-135m-instruct, the quickstart's).

    python tools/bench_sync.py --out bench_sync.json
    python tools/bench_sync.py --model smollm2-135m-instruct --tp 1 --method both --out bench_sync_smollm2.json
    python tools/bench_sync.py --tp 1 --bucket-mb 64 --compare-packed --out bench_sync_tp1.json
    python tools/bench_sync.py --hidden 256 --layers 2 --repeats 2   # a quick check
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    from tests.support.tiny_models import make_tiny_model

    return make_tiny_model(
        "qwen3",
        folder,
        tokenizer="char",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(2, hidden // 64 // 3),
        head_dim=64,
    )


def bench_ours(
    model: Path, tp: int, repeats: int, bucket_mb: int, run_dir: Path, method: str = "distributed", direct: bool = True
) -> dict[str, Any]:
    """Median seconds of a full sync through the trainer's components (Ray workers, engine pool), after one
    warm-up sync, over the transport `method` (sync.method), large tensors from their own memory or not
    (sync.direct)."""
    from userrl_megatron.config import load_config
    from userrl_megatron.config.resolve import resolve_config
    from userrl_megatron.trainer.components import start_components

    cfg = load_config(
        overrides=[
            f"model.path={model}",
            "model.tool_format=tags",
            f"megatron.tensor_model_parallel_size={tp}",
            f"megatron.devices_per_node={tp}",
            f"sync.bucket_mb={bucket_mb}",
            f"sync.method={method}",
            f"sync.direct={str(direct).lower()}",
            "gyms.train=[echo-procedural]",
        ]
    )

    async def run() -> list[dict[str, float]]:
        async with start_components(resolve_config(cfg), run_dir) as parts:
            await parts.weights.push(0)  # warm-up: first-touch allocations on both sides
            return [await parts.weights.push(version) for version in range(1, repeats + 1)]

    runs = asyncio.run(run())
    seconds = statistics.median(r["sync/seconds"] for r in runs)
    nbytes = runs[0]["sync/bytes"]
    phases = {
        k.removeprefix("sync/"): statistics.median(r[k] for r in runs)
        for k in runs[0]
        if k.endswith("_s") and "per" not in k
    }
    # What the sending thread waited on beyond its own phases: the HTTP session calls, the bucket hand-offs.
    phases["other_s"] = max(0.0, seconds - sum(phases.values()))
    return {
        "bytes": nbytes,
        "direct_bytes": runs[0].get("sync/direct_bytes", 0.0),
        "buckets": runs[0]["sync/buckets"],
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9,
        "phases": phases,
    }


def _raw_rank(rank: int, world_size: int, port: int, nbytes: int, repeats: int) -> list[float]:
    import torch

    from userrl_megatron.wire.group import init_custom_process_group

    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, rank, "raw_bench")
    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.distributed.broadcast(buffer, group=group, group_src=0)
        times.append(time.perf_counter() - start)
    return times


def bench_raw(nbytes: int, repeats: int) -> dict[str, Any]:
    """Median seconds of one gloo broadcast of `nbytes` from a sender to one receiver process."""
    from userrl_megatron.megatron.launch import run_local

    times = run_local(_raw_rank, 2, nbytes, repeats, threads_per_rank=1)
    seconds = statistics.median(max(pair) for pair in zip(*times, strict=True))
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}


def _split(result: dict[str, Any]) -> str:
    """A run's phase seconds as one line: `export 0.010, pack 0.076, ...`."""
    return ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in result["phases"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="", help="HF directory or embedded model name (default: random Qwen3)")
    parser.add_argument("--method", choices=("distributed", "tensor", "both"), default="distributed")
    parser.add_argument("--compare-packed", action="store_true", help="also time the broadcast with sync.direct=false")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.compare_packed and args.method == "tensor":
        parser.error("--compare-packed compares broadcasts: it needs --method distributed or both")
    from userrl_megatron.fleet.placement import ray_environment

    ray_environment()
    methods = ["distributed", "tensor"] if args.method == "both" else [args.method]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            from userrl_megatron.model_store import resolve_model

            model = resolve_model(args.model)
        else:
            model = make_model(Path(scratch) / "model", args.hidden, args.layers, args.vocab)
        for method in methods:
            run_dir = Path(scratch) / f"run_{method}"
            results[method] = bench_ours(model, args.tp, args.repeats, args.bucket_mb, run_dir, method)
        if args.compare_packed:
            run_dir = Path(scratch) / "run_packed"
            results["packed"] = bench_ours(model, args.tp, args.repeats, args.bucket_mb, run_dir, direct=False)
    first = results[methods[0]]
    raw = bench_raw(int(first["bytes"]), args.repeats)
    if args.model:
        described: dict[str, Any] = {"path": str(model), "bytes": first["bytes"]}
    else:
        described = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "params": first["bytes"] / 4}
    report: dict[str, Any] = {
        "model": described,
        "tp": args.tp,
        "bucket_mb": args.bucket_mb,
        "ours": first,
        "raw_gloo_broadcast": raw,
        "ratio": raw["seconds"] / first["seconds"],
    }
    if "tensor" in results and "distributed" in results:
        report["tensor"] = results["tensor"]
        report["tensor_vs_distributed"] = results["distributed"]["seconds"] / results["tensor"]["seconds"]
    if "packed" in results:
        report["packed"] = results["packed"]
        report["packed_ratio"] = raw["seconds"] / results["packed"]["seconds"]
        report["direct_vs_packed"] = results["packed"]["seconds"] / results["distributed"]["seconds"]
    text = json.dumps(report, indent=2)
    print(text)
    print(
        f"tp {args.tp}, {args.bucket_mb} MiB buckets ({first['buckets']:.0f}): "
        f"ours {first['seconds']:.3f} s ({_split(first)}); "
        f"raw gloo broadcast {raw['seconds']:.3f} s; ratio {report['ratio']:.2f}",
        file=sys.stderr,
    )
    if "packed" in report:
        packed = report["packed"]
        print(
            f"packed: {packed['seconds']:.3f} s ({_split(packed)}); ratio {report['packed_ratio']:.2f}; "
            f"direct / packed time {1 / report['direct_vs_packed']:.2f}",
            file=sys.stderr,
        )
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
