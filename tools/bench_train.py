"""Training throughput and MFU of the Megatron actor: forward + backward + optimizer step (`train_step`).

    python tools/bench_train.py --model synthetic-10m --steps 5 --compare-hf --out runs/bench/train_10m.json
    python tools/bench_train.py --model smollm2-135m-instruct --episodes 4 --seq-len 256 --steps 3
    python tools/bench_train.py --model synthetic-1b --dtype bfloat16 --tp 1 --episodes 16 --seq-len 4096  # GPU

Model FLOPs per step = 6 * N * tokens + 6 * L * (heads * head_dim) * sum(len^2): N counts the parameters
that take part in matmuls (the LM head, not the embedding lookup), and the second term is causal attention
(forward + backward). Only real tokens count, never padding. MFU divides the achieved model FLOP/s by the
device's peak: the dense bf16/fp16/tf32 peak of known GPUs (--peak-tflops overrides), and on CPU the fp32
GEMM throughput measured in the same run on the same cores (so the CPU MFU is "fraction of what a plain
large matmul reaches here"). `--compare-hf` also times a plain transformers + torch AdamW step on the same
batch in the same process, interleaved with the actor's steps so that load changes hit both alike, and
reports the ratio (world size 1 only); the plain step runs the same micro-batches as the actor
(--micro-batch-tokens), accumulating gradients. Step times are medians over the timed steps.

`--profile` prints (to stderr) torch.profiler's operator table of one more step of the actor, and of the plain
step with `--compare-hf`, after the timed ones.

`synthetic-*` models are random (config.json only, Megatron's own initialisation); others load HF weights.
The script writes one JSON object (to --out and stdout).
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from userrl_megatron.config.schema import AlgoConfig, MegatronConfig, ModelConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.launch import run_local
from userrl_megatron.megatron.packing import split_micro_batches
from userrl_megatron.model_store import resolve_model
from userrl_megatron.types import TrainBatch

SYNTHETIC = {  # Qwen2-style dense configs: (layers, hidden, heads, kv heads, ffn, vocab)
    "synthetic-10m": (6, 256, 8, 2, 1024, 8192),
    "synthetic-1b": (16, 2048, 32, 8, 8192, 128256),
}
# Dense peak FLOP/s per GPU by dtype (NVIDIA datasheets, SXM parts, no sparsity).
GPU_PEAKS = {
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},  # fp32 via TF32
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
}


def synthetic_model(name: str, root: Path) -> Path:
    """A folder holding only the config.json of a synthetic model."""
    layers, hidden, heads, kv, ffn, vocab = SYNTHETIC[name]
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_batch(vocab: int, episodes: int, seq_len: int, seed: int = 0, trained_share: float = 0.75) -> TrainBatch:
    """Episodes of `seq_len` tokens: the last `trained_share` of each trained with random advantages, the rest
    (prompt, user turns) not. The first token is never trained (nothing precedes it to score it)."""
    rng = random.Random(seed)
    prompt = seq_len - min(seq_len - 1, max(1, round(seq_len * trained_share)))
    ids = [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(episodes)]
    mask = [[0] * prompt + [1] * (seq_len - prompt) for _ in range(episodes)]
    adv = [[rng.gauss(0, 1) * m for m in row] for row in mask]
    return TrainBatch(token_ids=ids, loss_mask=mask, advantages=adv)


def model_flops(arch: Architecture, lengths: list[int]) -> float:
    """Useful FLOPs of one forward + backward over episodes of these lengths (see the module docstring)."""
    matmul_params = arch.num_parameters - (0 if arch.tied_embeddings else arch.vocab_size * arch.hidden_size)
    attention = 6 * arch.num_layers * arch.num_heads * arch.head_dim * sum(n * n for n in lengths)
    return 6.0 * matmul_params * sum(lengths) + attention


def cpu_gemm_peak(threads: int, size: int = 2048, trials: int = 5) -> float:
    """Best FLOP/s of a large fp32 matmul on `threads` threads (the CPU 'peak' the MFU is measured against)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return 2 * size**3 / best


def gpu_peak(dtype: str) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name()
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks[dtype], f"{name} datasheet ({dtype}, dense)"
    return None, f"{name}: unknown peak (pass --peak-tflops)"


def _bench_rank(rank: int, world: int, port: int, args: dict) -> dict:
    from userrl_megatron.megatron import parallel  # run_local stubbed what megatron.core needs without triton

    cfg = MegatronConfig(
        tensor_model_parallel_size=args["tp"],
        pipeline_model_parallel_size=args["pp"],
        devices_per_node=world,
        micro_batch_tokens=args["micro_batch_tokens"],
        recompute=args["recompute"],
        lr=1e-5,
    )
    parallel.initialize(cfg, rank=rank, world_size=world, master_port=port)
    from userrl_megatron.megatron.actor import MegatronActor

    actor = MegatronActor(
        ModelConfig(path=args["model_dir"], dtype=args["dtype"]), cfg, AlgoConfig(), 0, load_weights=args["weights"]
    )
    batch = make_batch(actor.arch.vocab_size, args["episodes"], args["seq_len"], trained_share=args["trained_share"])
    hf_step = None
    if args["compare_hf"]:
        hf_step = HFStep(Path(args["model_dir"]), batch, actor.dtype, args["micro_batch_tokens"])
    times, hf_times = [], []
    for step in range(args["warmup"] + args["steps"]):
        metrics = actor.train_step(batch)
        hf_time = hf_step() if hf_step else None  # interleaved, so load changes hit both alike
        if step >= args["warmup"]:
            times.append(metrics["actor/step_time_s"])
            hf_times.append(hf_time)
    memory = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    profiles = {}
    if args["profile"]:
        profiles["actor"] = profile_ops(lambda: actor.train_step(batch))
        if hf_step:
            profiles["hf"] = profile_ops(hf_step)
    parallel.shutdown()
    return {"step_times_s": times, "hf_step_times_s": hf_times, "max_gpu_memory_gib": memory, "profiles": profiles}


def profile_ops(step: Callable[[], object], rows: int = 25) -> str:
    """torch.profiler's table of the operators of one more step, by self time (CPU; and CUDA on a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


class HFStep:
    """One plain transformers + torch AdamW step on the batch (the same policy-gradient loss); returns seconds.

    It runs the batch in the micro-batches the actor runs (the same rows, `split_micro_batches` under the same
    token budget), accumulating gradients, so both sides do the same work at the same memory bound."""

    def __init__(self, model_dir: Path, batch: TrainBatch, dtype: torch.dtype, micro_batch_tokens: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if any(model_dir.glob("*.safetensors")):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        lengths = [len(t) for t in batch.token_ids]
        if len(set(lengths)) != 1:
            raise ValueError("HFStep needs episodes of one length (make_batch's)")
        rows = split_micro_batches(range(len(batch)), lengths, micro_batch_tokens, packed=False)
        self.micro_batches = [torch.tensor(sorted(r), device=self.device) for r in rows]
        self.ids = torch.tensor(batch.token_ids, device=self.device)
        self.mask = torch.tensor(batch.loss_mask, device=self.device, dtype=torch.float32)[:, 1:]
        self.adv = torch.tensor(batch.advantages, device=self.device, dtype=torch.float32)[:, 1:]
        self.trained = self.mask.sum()

    def __call__(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        for rows in self.micro_batches:
            ids = self.ids[rows]
            logits = self.model(ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logp * self.adv[rows] * self.mask[rows]).sum() / self.trained
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic-10m", help=f"{', '.join(SYNTHETIC)}, an embedded model or an HF dir")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--episodes", type=int, default=8, help="episodes per train_step (the global batch)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per episode")
    p.add_argument("--trained-share", type=float, default=0.75, help="share of each episode's tokens trained")
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak per rank (overrides the table)")
    p.add_argument("--compare-hf", action="store_true", help="also time a plain transformers step (world 1)")
    p.add_argument("--profile", action="store_true", help="print an operator profile of one more step of each side")
    p.add_argument("--out", default=None, help="JSON output file")
    args = p.parse_args()

    world = args.tp * args.pp * args.dp
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = args.model in SYNTHETIC
        model_dir = synthetic_model(args.model, Path(tmp)) if synthetic else resolve_model(args.model)
        arch = Architecture.from_hf_dir(model_dir)
        rank_args = {
            **vars(args),
            "model_dir": str(model_dir),
            "weights": not synthetic,
            "micro_batch_tokens": max(args.micro_batch_tokens, args.seq_len),
        }
        cpu_peak = None if torch.cuda.is_available() else cpu_gemm_peak(os.cpu_count() or 1)  # before the ranks
        if args.compare_hf and world != 1:
            sys.exit("--compare-hf needs world size 1")
        results = run_local(_bench_rank, world, rank_args, timeout_s=3600)
        step_time = statistics.median(results[0]["step_times_s"])
        batch = make_batch(arch.vocab_size, args.episodes, args.seq_len)
        lengths = [len(t) for t in batch.token_ids]
        if args.peak_tflops is not None:
            peak, peak_source = args.peak_tflops * 1e12 * world, "--peak-tflops"
        elif torch.cuda.is_available():
            peak, peak_source = gpu_peak(args.dtype)
            peak = peak * world if peak else None
        else:
            peak, peak_source = cpu_peak, "measured fp32 GEMM (best of 5), all cores"
        flops = model_flops(arch, lengths)
        report = {
            "model": args.model,
            "parameters": arch.num_parameters,
            "layout": {"tp": args.tp, "pp": args.pp, "dp": args.dp},
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{os.cpu_count()}",
            "episodes": args.episodes,
            "seq_len": args.seq_len,
            "trained_share": args.trained_share,
            "tokens_per_step": sum(lengths),
            "step_time_s": step_time,
            "tokens_per_s": sum(lengths) / step_time,
            "model_tflops_per_s": flops / step_time / 1e12,
            "peak_tflops_per_s": peak / 1e12 if peak else None,
            "peak_source": peak_source,
            "mfu": flops / step_time / peak if peak else None,
            "max_gpu_memory_gib": results[0]["max_gpu_memory_gib"],
        }
        if args.compare_hf:
            hf_time = statistics.median(results[0]["hf_step_times_s"])
            report["hf_step_time_s"] = hf_time
            report["speed_vs_hf"] = hf_time / step_time
    for side, table in results[0]["profiles"].items():
        print(f"operator profile, one {side} step:\n{table}", file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
