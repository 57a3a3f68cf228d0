"""Checkpoint save cost: how long a training step is held by a save, per optimizer format and save mode.

The quickstart's model (SmolLM2-135M, fp32) is trained one step by a Megatron actor with the distributed
optimizer over data-parallel ranks (gloo on CPU), so Adam's state exists, then saved repeatedly:

- `fully_reshardable`, inline: the optimizer state is gathered per parameter across DP, then written;
- `dp_reshardable`, inline: each rank writes its own optimizer shard, nothing is gathered;
- `dp_reshardable`, background: the step is held only while the tensors are copied to host staging buffers;
  the files are written on a thread (`write_s`: from the save's start until it is committed);
- model only (the quickstart's `checkpoint.save_optimizer: false`), inline and background.

Reported: median seconds the caller is held (`stall_s`) and, for background saves, until committed; ratios
against the inline fully_reshardable save in the same run.

    python tools/bench_checkpoint.py --out bench_checkpoint.json
    python tools/bench_checkpoint.py --ranks 1 --repeats 1   # a quick check
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = {  # name -> (optimizer format, with optimizer, background)
    "fully_reshardable_inline": ("fully_reshardable", True, False),
    "dp_reshardable_inline": ("dp_reshardable", True, False),
    "dp_reshardable_background": ("dp_reshardable", True, True),
    "model_only_inline": ("dp_reshardable", False, False),
    "model_only_background": ("dp_reshardable", False, True),
}


def _rank(rank: int, world: int, port: int, model: str, root: str, repeats: int) -> dict[str, Any]:
    from tests.support.distributed import build_actor, init_world, megatron_config, random_batch

    cfg = megatron_config(micro_batch_tokens=512)
    init_world(rank, world, port, cfg)
    actor = build_actor(Path(model), cfg)
    actor.train_step(random_batch(actor.arch.vocab_size, [200, 150], seed=0))  # Adam's state now exists
    out: dict[str, Any] = {}
    for name, (fmt, with_optimizer, background) in MODES.items():
        stalls, totals = [], []
        for i in range(repeats + 1):  # the first save of each mode warms up (plans, staging buffers)
            start = time.perf_counter()
            actor.save(f"{root}/{name}/step_{i}", {}, 1, with_optimizer, fmt, background=background)
            held = time.perf_counter() - start
            actor.finish_save(wait=True)
            if i:
                stalls.append(held)
                totals.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in Path(root, name).rglob("*") if f.is_file())
        out[name] = {
            "stall_s": round(statistics.median(stalls), 3),
            "write_s": round(statistics.median(totals), 3),
            "bytes": size,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (gloo processes)")
    parser.add_argument("--repeats", type=int, default=2, help="timed saves per mode, after one warm-up")
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    args = parser.parse_args()

    from userrl_megatron.megatron.launch import run_local
    from userrl_megatron.model_store import resolve_model

    model = str(resolve_model("smollm2-135m-instruct"))
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as root:
        modes = run_local(_rank, args.ranks, model, root, args.repeats, timeout_s=3600)[0]
    base = modes["fully_reshardable_inline"]["stall_s"]
    result = {
        "model": "smollm2-135m-instruct fp32",
        "ranks": args.ranks,
        "repeats": args.repeats,
        "modes": modes,
        "stall_ratio_vs_fully_reshardable": {k: round(v["stall_s"] / base, 3) for k, v in modes.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
