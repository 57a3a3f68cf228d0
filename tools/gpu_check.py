"""`make gpu-check`: the most evidence one GPU gives in about 8 minutes (docs/gpu.md has the device procedure).

    python tools/gpu_check.py --out runs/gpu_check/report.json             # one CUDA GPU
    python tools/gpu_check.py --device cpu --out runs/gpu_check/cpu.json   # the same phases, tiny, on CPU (CI)

A smoke sequence on a random Qwen3 built from a config (about 0.3B parameters on CUDA, no downloads), run by the
project's own modules in one process of its own (world size 1: NCCL on CUDA, gloo on CPU, no Ray):

  environment       versions and the device
  model             the random Qwen3, saved as an HF directory (fp32 safetensors)
  plan              `userrl plan`'s prediction (`plan.plan_run`) for the layout the phases below use
  actor_vs_hf_fp32  the Megatron actor's log-probs in fp32 against transformers' on the same device
  train             two training steps (bf16 on CUDA): tokens/s, MFU, measured peak memory beside the plan's
  offload           what `offload` frees per kind beside the plan; log-probs bit-equal after `onload`
  engine_start      an embedded engine server on the same device
  weight_sync       the colocated sync (CUDA-IPC handles on CUDA, shared-memory files on CPU) of the trained
                    weights; every tensor read back from the engine equal
  engine_requests   greedy, seeded sampled, penalised and prompt-log-prob requests
  logprob_mismatch  the engine's log-probs of sampled tokens against the actor's
  throughput        output tokens/s at 32 concurrent requests (and at one)
  release_resume    the engine releases its weights and KV cache (device memory freed) and resumes (same output)

then `tests/gpu` (pytest, in a process of its own). Each phase has a time budget; a phase that raises is recorded
(type, message, the last traceback lines) and the next one runs (phases that need what it would have made are
skipped, naming it); a phase over its budget stops the smoke process, and what did not run is listed as skipped.
The whole check stops starting phases at --budget-s. It prints a table and writes JSON (--out), the smoke
process's log beside it (.log), the engine's (.engine.log) and pytest's (.pytest.log). Exit status 0 when every
phase passed.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python tools/gpu_check.py`: the project and tests/support from the checkout
    sys.path.insert(0, str(REPO))

GIB = 2**30
SCHEMA_VERSION = 1
BETWEEN_PHASES_S = 120.0  # the smoke process's start (imports) and its clean-up after the last phase


@dataclass(frozen=True)
class Sizes:
    """What the phases build and run on one device kind."""

    model: dict[str, Any]  # Qwen3 config fields (tests/support/tiny_models.tiny_config overrides)
    dtype: str  # the training and serving dtype
    logprob_lengths: tuple[int, ...]  # sequences of the fp32 comparison
    fp32_tolerance: float  # max |actor - transformers| of an fp32 log-prob
    episodes: int  # training batch: episodes of seq_len tokens
    seq_len: int
    micro_batch_tokens: int
    lr: float  # large enough that two steps change the weights the sync carries
    prompt_len: int  # engine requests
    new_tokens: int
    concurrent: int  # requests in flight for the throughput figure
    concurrent_new_tokens: int
    mismatch_requests: int
    mismatch_new_tokens: int
    read_rows: int  # rows of every tensor read back after the sync
    budget_s: dict[str, float]  # per phase
    total_budget_s: float  # no phase starts after this


QWEN3_03B = dict(  # Qwen3-0.6B's widths and vocabulary with 10 layers: 0.31B parameters (tied embeddings)
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
QWEN3_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

SIZES = {
    "cuda": Sizes(
        model=QWEN3_03B,
        dtype="bfloat16",
        logprob_lengths=(512, 300, 97, 1024),
        fp32_tolerance=1e-3,
        episodes=16,
        seq_len=2048,  # 32,768 tokens a step
        micro_batch_tokens=8192,
        lr=1e-3,
        prompt_len=64,
        new_tokens=32,
        concurrent=32,
        concurrent_new_tokens=256,
        mismatch_requests=4,
        mismatch_new_tokens=64,
        read_rows=4,
        budget_s=dict(
            environment=30,
            model=60,
            plan=60,
            actor_vs_hf_fp32=90,
            train=90,
            offload=30,
            engine_start=120,
            weight_sync=60,
            engine_requests=45,
            logprob_mismatch=30,
            throughput=60,
            release_resume=45,
            tests_gpu=240,
        ),
        total_budget_s=480,
    ),
    "cpu": Sizes(
        model=QWEN3_TINY,
        dtype="float32",
        logprob_lengths=(40, 17, 63),
        fp32_tolerance=1e-4,
        episodes=4,
        seq_len=48,
        micro_batch_tokens=128,
        lr=1e-3,
        prompt_len=12,
        new_tokens=6,
        concurrent=4,
        concurrent_new_tokens=8,
        mismatch_requests=2,
        mismatch_new_tokens=8,
        read_rows=4,
        budget_s=dict(
            environment=30,
            model=30,
            plan=60,
            actor_vs_hf_fp32=60,
            train=60,
            offload=30,
            engine_start=90,
            weight_sync=30,
            engine_requests=30,
            logprob_mismatch=30,
            throughput=30,
            release_resume=30,
            tests_gpu=120,
        ),
        total_budget_s=420,
    ),
}


@dataclass(frozen=True)
class Phase:
    """One step of the smoke sequence: its name, what it needs from earlier phases, and its function."""

    name: str
    needs: tuple[str, ...]  # Smoke attributes an earlier phase sets
    run: Callable[["Smoke", "Record"], None]


@dataclass
class Record:
    """A phase's outcome: checks (each true or false, with a detail), figures, and what went wrong."""

    name: str
    budget_s: float = 0.0
    status: str = "skipped"  # passed, failed (a check), error (an exception), timeout, skipped
    seconds: float = 0.0
    summary: str = ""  # one line for the table
    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    reason: str = ""  # why it was skipped or stopped

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check; returns `ok`."""
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def figure(self, **values: Any) -> None:
        self.figures.update(values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# The smoke sequence (runs in a process of its own)
# ---------------------------------------------------------------------------------------------------------------


class Smoke:
    """State the phases hand on: the model directory, the plan, the actor, the engine server."""

    def __init__(self, device: str, sizes: Sizes, work: Path, engine_log: Path) -> None:
        self.device, self.sizes, self.work, self.engine_log = device, sizes, work, engine_log
        self.model_dir: Path | None = None
        self.arch: Any = None
        self.plan: dict[str, int] | None = None
        self.actor: Any = None  # megatron.actor.MegatronActor: rank 0 of a world of one, in this process
        self.server: Any = None  # rollout.launch.ServerProcess
        self.synced: bool | None = None
        self.port = 0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop(timeout_s=20)
        if self.actor is not None:
            from userrl_megatron.megatron import parallel

            with contextlib.suppress(Exception):
                parallel.shutdown()

    # ---- helpers ----

    def synchronize(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else None

    def device_free(self) -> int | None:
        """Free bytes of the whole device (every process on it), CUDA only."""
        import torch

        return torch.cuda.mem_get_info()[0] if self.cuda else None

    def megatron_config(self) -> Any:
        from userrl_megatron.config.schema import MegatronConfig

        s = self.sizes
        return MegatronConfig(micro_batch_tokens=s.micro_batch_tokens, lr=s.lr, adam_eps=1e-6)

    def layout_overrides(self) -> list[str]:
        """The `userrl plan` overrides of the layout the phases use: one GPU shared by the actor and one
        embedded engine (colocated, tensor-handle sync)."""
        s = self.sizes
        device_gb = self._device_gib() if self.cuda else 80.0
        return [
            f"model.path={self.model_dir}",
            f"model.dtype={s.dtype}",
            f"megatron.micro_batch_tokens={s.micro_batch_tokens}",
            f"rollout.max_prompt_tokens={s.seq_len // 2}",  # an episode of the training batch's length
            f"rollout.max_response_tokens={s.seq_len - s.seq_len // 2}",
            f"rollout.max_new_tokens_per_turn={s.seq_len - s.seq_len // 2}",
            f"megatron.lr={s.lr}",
            "megatron.offload=true",
            "rollout.backend=embedded",
            "rollout.colocate=true",
            "rollout.num_engines=1",
            "rollout.engine_tp=1",
            "sync.method=tensor",
            f"plan.device_memory_gb={device_gb:.1f}",
        ]

    def _device_gib(self) -> float:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB

    def random_prompts(self, count: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(self.arch.vocab_size) for _ in range(length)] for _ in range(count)]

    def actor_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        from userrl_megatron.types import TrainBatch

        return self.actor.compute_logprobs(TrainBatch(seqs, [], []))

    def client(self) -> Any:
        from userrl_megatron.rollout.engine import SGLangClient

        return SGLangClient(self.server.url, timeout_s=300)

    def generate_raw(self, body: dict[str, Any]) -> dict[str, Any]:
        """One `/generate` call with SGLang's full body (penalties, prompt log-probs)."""
        import asyncio

        async def go() -> dict[str, Any]:
            async with self.client() as client:
                status, answer = await client._request("POST", "/generate", body, timeout_s=300)
            if status != 200:
                raise RuntimeError(f"/generate answered HTTP {status}: {answer}")
            return answer

        return asyncio.run(go())


def phase_environment(smoke: Smoke, r: Record) -> None:
    import torch
    import transformers

    from userrl_megatron.megatron import parallel  # noqa: F401  (installs the CPU support megatron.core needs)

    megatron_version = _version("megatron-core")
    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "megatron_core": megatron_version,
        "omegaconf": _version("omegaconf"),
        "cpu_count": os.cpu_count(),
        "device": smoke.device,
        "git_commit": _git_commit(),
    }
    if smoke.cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / GIB, 2),
            multiprocessors=props.multi_processor_count,
            driver=_driver_version(),
        )
    else:
        figures.update(device_name=f"cpu x{os.cpu_count()}")
    r.figure(**figures)
    r.check("megatron_core_importable", megatron_version is not None, f"megatron-core {megatron_version}")
    r.summary = (
        f"{figures['device_name']}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"megatron-core {megatron_version}, Python {figures['python']}"
    )


def phase_model(smoke: Smoke, r: Record) -> None:
    from tests.support.tiny_models import make_tiny_model
    from userrl_megatron.convert.arch import Architecture

    smoke.model_dir = make_tiny_model("qwen3", smoke.work / "qwen3", seed=11, **smoke.sizes.model)
    smoke.arch = arch = Architecture.from_hf_dir(smoke.model_dir)
    size = sum(f.stat().st_size for f in smoke.model_dir.iterdir())
    r.figure(
        parameters=arch.num_parameters,
        layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        heads=arch.num_heads,
        kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        tied_embeddings=arch.tied_embeddings,
        bytes_on_disk=size,
    )
    r.summary = (
        f"Qwen3, {arch.num_parameters / 1e6:,.1f}M parameters, {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"vocab {arch.vocab_size}"
    )


def phase_plan(smoke: Smoke, r: Record) -> None:
    from userrl_megatron.config import load_config
    from userrl_megatron.plan import plan_run
    from userrl_megatron.plan.memory import engine_memory

    overrides = smoke.layout_overrides()
    cfg = load_config([], overrides, command="gpu-check")
    plan = plan_run(cfg)
    training = _row_held(plan, "training")
    actor_training = sum(v for k, v in training.items() if k.startswith("actor "))
    engine = engine_memory(smoke.arch, cfg.rollout, cfg.model.dtype, cfg.plan)
    smoke.plan = {
        "training_bytes": sum(training.values()),
        "training_actor_bytes": actor_training,
        "actor_weights_bytes": training.get("actor weights", 0),
        "actor_grads_bytes": training.get("actor grads", 0),
        "actor_optimizer_bytes": training.get("actor optimizer", 0),
        "actor_activations_bytes": training.get("actor activations", 0),
        "actor_logits_bytes": training.get("actor logits", 0),
        "sync_buckets_bytes": _row_held(plan, "weight sync").get("sync buckets (2)", 0),
        "engine_weights_bytes": engine.weights,
        "host_offload_bytes": sum(h.held.get("offload", 0) for h in plan.host),
    }
    r.figure(layout=overrides, phase_bytes=plan.phase_bytes(), **smoke.plan)
    r.check("plan_has_training", actor_training > 0)
    r.summary = (
        f"training peak {_gib(plan.phase_bytes().get('training'))} of which actor {_gib(actor_training)}; "
        f"weight sync {_gib(plan.phase_bytes().get('weight sync'))}"
    )


def phase_actor_vs_hf(smoke: Smoke, r: Record) -> None:
    import torch

    from tests.support.distributed import max_abs_diff, random_sequences
    from userrl_megatron.config.schema import ModelConfig

    seqs = random_sequences(smoke.arch.vocab_size, list(smoke.sizes.logprob_lengths), seed=3)
    fp32 = _build_actor(ModelConfig(path=str(smoke.model_dir)), smoke)
    try:
        actor = fp32.compute_logprobs(_batch(seqs))
    finally:
        del fp32
        gc.collect()
    expected = _hf_logprobs(smoke.model_dir, seqs, "cuda" if smoke.cuda else "cpu")
    if smoke.cuda:
        torch.cuda.empty_cache()
    diff = max_abs_diff(actor, expected)
    flat = [abs(a - b) for ra, rb in zip(actor, expected, strict=True) for a, b in zip(ra, rb, strict=True)]
    r.figure(
        sequences=len(seqs),
        tokens=sum(len(s) for s in seqs),
        max_abs_diff=diff,
        mean_abs_diff=sum(flat) / len(flat),
        tolerance=smoke.sizes.fp32_tolerance,
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
    )
    r.check("fp32_logprobs_match", diff <= smoke.sizes.fp32_tolerance, f"max |diff| {diff:.2e}")
    r.summary = f"max |actor - transformers| {diff:.2e} over {sum(len(s) for s in seqs)} tokens (fp32)"


def phase_train(smoke: Smoke, r: Record) -> None:
    import bench_train  # tools/bench_train.py: the batch, FLOPs and device peaks of the training benchmark
    import torch

    from userrl_megatron.config.schema import ModelConfig

    s = smoke.sizes
    gc.collect()
    if smoke.cuda:
        torch.cuda.empty_cache()
    baseline = smoke.allocated()
    smoke.actor = _build_actor(ModelConfig(path=str(smoke.model_dir), dtype=s.dtype), smoke)
    batch = bench_train.make_batch(smoke.arch.vocab_size, s.episodes, s.seq_len, seed=5)
    if smoke.cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = [smoke.actor.train_step(batch) for _ in range(2)]
    smoke.synchronize()
    tokens = sum(len(t) for t in batch.token_ids)
    times = [m["actor/step_time_s"] for m in steps]
    flops = bench_train.model_flops(smoke.arch, [len(t) for t in batch.token_ids])
    peak, peak_source = bench_train.gpu_peak(s.dtype) if smoke.cuda else (None, "no device peak on CPU")
    r.figure(
        dtype=s.dtype,
        transformer_engine=smoke.actor.packed,  # else the local spec (torch SDPA attention)
        tokens_per_step=tokens,
        micro_batch_tokens=s.micro_batch_tokens,
        step_times_s=times,
        tokens_per_s=tokens / times[-1],
        model_tflops_per_s=flops / times[-1] / 1e12,
        mfu=flops / times[-1] / peak if peak else None,
        peak_source=peak_source,
        losses=[m["actor/loss"] for m in steps],
        grad_norms=[m["actor/grad_norm"] for m in steps],
    )
    r.check("finite_losses", all(math.isfinite(m["actor/loss"]) for m in steps))
    r.check("finite_grad_norms", all(math.isfinite(m["actor/grad_norm"]) for m in steps))
    summary = f"{s.dtype}: {tokens / times[-1]:,.0f} tokens/s"
    if peak:
        summary += f", MFU {flops / times[-1] / peak:.1%}"
    if smoke.cuda:
        measured = torch.cuda.max_memory_allocated() - (baseline or 0)
        r.figure(
            baseline_bytes=baseline,
            measured_peak_bytes=measured,
            measured_peak_reserved_bytes=torch.cuda.max_memory_reserved(),
        )
        if smoke.plan:
            predicted = smoke.plan["training_actor_bytes"]
            r.figure(predicted_peak_bytes=predicted, measured_over_predicted=measured / predicted)
            r.check(
                "plan_covers_training_peak",
                measured <= predicted,
                f"measured {_gib(measured)}, plan {_gib(predicted)}",
            )
            summary += f"; peak {_gib(measured)}, plan {_gib(predicted)}"
        else:
            r.check("plan_covers_training_peak", False, "no plan (the plan phase did not run)")
    r.summary = summary


def phase_offload(smoke: Smoke, r: Record) -> None:
    from userrl_megatron.megatron.offload import GRADS, STATE, WEIGHTS

    actor = smoke.actor
    probe = smoke.random_prompts(2, 32, seed=9)
    before_logprobs = actor.compute_logprobs(_batch(probe))
    smoke.synchronize()
    before = smoke.allocated()
    actor.offload()
    after = smoke.allocated()
    parked: dict[str, int] = {}
    for kind, _, nbytes in actor.parking.parked.values():
        parked[kind] = parked.get(kind, 0) + nbytes
    host = actor.parking.arena.nbytes
    actor.onload()
    same = actor.compute_logprobs(_batch(probe)) == before_logprobs
    r.figure(
        offloaded_weights_bytes=parked.get(WEIGHTS, 0),
        offloaded_grads_bytes=parked.get(GRADS, 0),
        offloaded_optimizer_bytes=parked.get(STATE, 0),
        host_arena_bytes=host,
        device_freed_bytes=None if before is None or after is None else before - after,
    )
    r.check("logprobs_bit_equal_after_onload", same)
    freed = sum(parked.values())
    summary = f"freed {_gib(freed)}"
    if smoke.plan:
        plan = smoke.plan
        for kind, key in ((WEIGHTS, "actor_weights_bytes"), (GRADS, "actor_grads_bytes")):
            r.check(
                f"{key[:-6]}_as_planned", _close(parked.get(kind, 0), plan[key], 0.02), _vs(parked.get(kind), plan[key])
            )
        # The plan counts Adam's moments and the fp32 master copy; fp32 models have no separate master copy.
        r.check(
            "actor_optimizer_as_planned",
            _close(parked.get(STATE, 0), plan["actor_optimizer_bytes"], 0.02),
            _vs(parked.get(STATE), plan["actor_optimizer_bytes"]),
        )
        predicted = plan["actor_weights_bytes"] + plan["actor_grads_bytes"] + plan["actor_optimizer_bytes"]
        r.figure(predicted_bytes=predicted, predicted_host_bytes=plan["host_offload_bytes"])
        if before is not None and after is not None:
            r.check(
                "device_memory_freed_as_planned",
                _close(before - after, predicted, 0.05),
                _vs(before - after, predicted),
            )
        r.check("host_arena_as_planned", host == plan["host_offload_bytes"], _vs(host, plan["host_offload_bytes"]))
        summary += f", plan {_gib(predicted)}; host {_gib(host)}, plan {_gib(plan['host_offload_bytes'])}"
    r.summary = summary


def phase_engine_start(smoke: Smoke, r: Record) -> None:
    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.megatron.launch import free_port
    from userrl_megatron.rollout.launch import launch_embedded

    cfg = EmbeddedServerConfig(
        device=smoke.device,
        max_running_requests=64,
        threads=0 if smoke.cuda else 1,
        startup_timeout_s=smoke.sizes.budget_s["engine_start"],
    )
    free = smoke.device_free()
    start = time.perf_counter()
    smoke.server = launch_embedded(str(smoke.model_dir), cfg, free_port(), smoke.sizes.dtype, log_path=smoke.engine_log)
    seconds = time.perf_counter() - start
    used = None if free is None else free - (smoke.device_free() or 0)
    r.figure(startup_s=seconds, device_bytes_used=used, url=smoke.server.url, dtype=smoke.sizes.dtype)
    r.summary = f"healthy after {seconds:.1f} s" + ("" if used is None else f", {_gib(used)} on the device")


def phase_weight_sync(smoke: Smoke, r: Record) -> None:
    import asyncio

    import torch
    from safetensors import safe_open

    from userrl_megatron.config.schema import SyncConfig
    from userrl_megatron.sync.sender import EngineEndpoint
    from userrl_megatron.sync.tensor_sender import TensorSender

    rows = smoke.sizes.read_rows
    actor = smoke.actor
    # What `MegatronWorker.connect_engines(..., "tensor")` sets up for the only rank of a world of one: a sender of
    # handles to memory on its device, to the engine on the same device.
    device = f"cuda:{torch.cuda.current_device()}" if smoke.cuda else "cpu"
    engine = EngineEndpoint(smoke.server.url, tp_size=1, first_device=0)
    sender = TensorSender(SyncConfig(), [engine], "gpu_check_pp0", device)
    sender.connect()
    expected = {name: t[:rows].detach().to("cpu", torch.float32).clone() for name, t in actor.export_hf_weights()}
    smoke.synchronize()
    before = smoke.allocated()
    if smoke.cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        metrics = sender.push(actor.export_hf_weights(), version=1)
    finally:
        sender.close()
    smoke.synchronize()
    after = smoke.allocated()
    peak = torch.cuda.max_memory_allocated() - (before or 0) if smoke.cuda else None

    async def read() -> tuple[str, dict[str, Any]]:
        async with smoke.client() as client:
            version = str((await client.get_model_info())["weight_version"])
            return version, {n: await client.get_weights_by_name(n, truncate_size=rows) for n in expected}

    version, got = asyncio.run(read())
    unequal = [n for n, t in expected.items() if not torch.equal(torch.tensor(got[n], dtype=torch.float32), t)]
    initial = {}  # the weights the engine loaded, as the actor first held them (in its dtype)
    for shard in sorted(smoke.model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            stored = set(f.keys())
            for n in (n for n in expected if n in stored):
                initial[n] = f.get_slice(n)[:rows].to(actor.dtype).to(torch.float32)
    matrices = [n for n, t in expected.items() if t.dim() == 2 and n in initial]
    unchanged = [n for n in matrices if torch.equal(initial[n], expected[n])]
    smoke.synced = not unequal
    r.figure(
        transport="CUDA IPC handles" if smoke.cuda else "shared-memory files",
        tensors=len(expected),
        rows_compared=rows,
        unequal=unequal[:20],
        matrices=len(matrices),
        matrices_unchanged_by_training=unchanged[:20],
        weight_version=version,
        bucket_bytes_left=None if before is None or after is None else after - before,
        **{k.removeprefix("sync/"): v for k, v in (metrics or {}).items()},
    )
    r.check("every_tensor_read_back_equal", not unequal, f"{len(unequal)} of {len(expected)} differ")
    r.check("weight_version_is_1", version == "1", version)
    r.check(
        "training_changed_every_matrix",
        bool(matrices) and not unchanged,
        f"{len(unchanged)} of {len(matrices)} unchanged",
    )
    if before is not None and after is not None:
        r.check("buckets_freed", after == before, f"{after - before} bytes left")
    if peak is not None and smoke.plan:
        planned = smoke.plan["sync_buckets_bytes"]
        r.figure(measured_peak_bytes=peak, predicted_peak_bytes=planned)
        r.check("plan_covers_sync_peak", peak <= planned, _vs(peak, planned))
    sent = (metrics or {}).get("sync/bytes", 0.0)
    r.summary = (
        f"{len(expected)} tensors, {_gib(sent)} in {(metrics or {}).get('sync/seconds', 0.0):.2f} s "
        f"({(metrics or {}).get('sync/gb_per_s', 0.0):.1f} GB/s), {len(unequal)} unequal"
    )


def phase_engine_requests(smoke: Smoke, r: Record) -> None:
    s = smoke.sizes
    prompt = smoke.random_prompts(1, s.prompt_len, seed=21)[0]

    def generate(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return smoke.generate_raw({"input_ids": prompt, "sampling_params": params, "return_logprob": True, **extra})

    def ids(answer: dict[str, Any]) -> list[int]:
        return list(answer["output_ids"])

    def finished(answer: dict[str, Any]) -> bool:
        return (answer["meta_info"].get("finish_reason") or {}).get("type") == "length" and len(
            ids(answer)
        ) == s.new_tokens

    greedy = {"max_new_tokens": s.new_tokens, "temperature": 0.0}
    first, second = generate(greedy), generate(greedy)
    r.check("greedy_full_length", finished(first), str(first["meta_info"].get("finish_reason")))
    r.check("greedy_repeatable", ids(first) == ids(second))
    sampled = {"max_new_tokens": s.new_tokens, "temperature": 0.8, "top_p": 0.95, "top_k": 50, "sampling_seed": 7}
    a, b, c = generate(sampled), generate(sampled), generate({**sampled, "sampling_seed": 8})
    r.check("sampled_full_length", finished(a), str(a["meta_info"].get("finish_reason")))
    r.check("seed_repeats", ids(a) == ids(b))
    r.check("other_seed_differs", ids(a) != ids(c))
    penalties = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.3}
    penalised = generate({**greedy, **penalties})
    r.check("penalised_full_length", finished(penalised), str(penalised["meta_info"].get("finish_reason")))
    logprobs = [lp for lp, _, _ in penalised["meta_info"]["output_token_logprobs"]]
    r.check("penalised_logprobs_finite", all(math.isfinite(lp) for lp in logprobs))
    scored = generate(greedy, logprob_start_len=0, top_logprobs_num=2)
    prompt_lp = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"]]
    r.check("prompt_logprobs_cover_the_prompt", len(prompt_lp) == len(prompt) and prompt_lp[0] is None)
    tops = scored["meta_info"].get("input_top_logprobs") or []
    r.check("prompt_top_logprobs", len(tops) == len(prompt) and all(len(t) == 2 for t in tops[1:]))
    diff = None
    if smoke.actor is not None and smoke.synced:
        actor = smoke.actor_logprobs([prompt])[0]
        diff = max(abs(a - e) for a, e in zip(actor[1:], prompt_lp[1:], strict=True))
        r.check("prompt_logprobs_match_the_actor", diff < 0.1, f"max |diff| {diff:.2e}")
    r.figure(
        greedy_tokens=len(ids(first)),
        distinct_greedy=len(set(ids(first))),
        distinct_penalised=len(set(ids(penalised))),
        prompt_logprob_vs_actor_max_abs=diff,
    )
    r.summary = "greedy, seeded sampling, penalties, prompt log-probs" + (
        "" if diff is None else f"; prompt log-probs vs actor {diff:.2e}"
    )


def phase_logprob_mismatch(smoke: Smoke, r: Record) -> None:
    import asyncio

    from userrl_megatron.types import SamplingParams

    if not smoke.synced:
        raise RuntimeError("the engine does not hold the actor's weights (weight_sync did not pass)")
    s = smoke.sizes
    prompts = smoke.random_prompts(s.mismatch_requests, s.prompt_len, seed=31)
    sampling = SamplingParams(max_new_tokens=s.mismatch_new_tokens, temperature=1.0, seed=5)

    async def run() -> list[Any]:
        async with smoke.client() as client:
            return list(await asyncio.gather(*(client.generate(p, sampling) for p in prompts)))

    generations = asyncio.run(run())
    actor = smoke.actor_logprobs([p + g.output_ids for p, g in zip(prompts, generations, strict=True)])
    diffs = []
    for p, g, row in zip(prompts, generations, actor, strict=True):
        diffs += [a - e for a, e in zip(row[len(p) :], g.output_logprobs, strict=True)]
    absolute = [abs(d) for d in diffs]
    mean_abs = sum(absolute) / len(absolute)
    ratio = sum(abs(math.exp(d) - 1) for d in diffs) / len(diffs)
    r.figure(
        tokens=len(diffs),
        max_abs=max(absolute),
        mean_abs=mean_abs,
        mean_signed=sum(diffs) / len(diffs),
        mean_abs_ratio_minus_1=ratio,
        dtype=s.dtype,
    )
    r.check("mismatch_small", mean_abs < 0.05 and max(absolute) < 0.5, f"mean {mean_abs:.2e}, max {max(absolute):.2e}")
    r.summary = f"{len(diffs)} sampled tokens: mean |actor - engine| {mean_abs:.2e}, max {max(absolute):.2e}"


def phase_throughput(smoke: Smoke, r: Record) -> None:
    import asyncio

    from userrl_megatron.types import SamplingParams

    s = smoke.sizes
    prompts = smoke.random_prompts(s.concurrent, s.prompt_len, seed=41)
    sampling = SamplingParams(max_new_tokens=s.concurrent_new_tokens, temperature=1.0)

    async def run(batch: list[list[int]]) -> tuple[float, list[Any]]:
        async with smoke.client() as client:
            start = time.perf_counter()
            out = await asyncio.gather(*(client.generate(p, sampling) for p in batch))
            return time.perf_counter() - start, list(out)

    single_s, single = asyncio.run(run(prompts[:1]))
    wall, generations = asyncio.run(run(prompts))
    tokens = sum(len(g.output_ids) for g in generations)
    r.figure(
        concurrent=s.concurrent,
        new_tokens_each=s.concurrent_new_tokens,
        output_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall,
        single_request_tokens_per_s=len(single[0].output_ids) / single_s,
        mean_latency_s=sum(g.latency_s for g in generations) / len(generations),
    )
    r.check("every_request_full_length", all(len(g.output_ids) == s.concurrent_new_tokens for g in generations))
    r.summary = (
        f"{tokens / wall:,.0f} tokens/s at {s.concurrent} concurrent ({len(single[0].output_ids) / single_s:,.0f} at 1)"
    )


def phase_release_resume(smoke: Smoke, r: Record) -> None:
    import asyncio

    from userrl_megatron.types import SamplingParams

    prompt = smoke.random_prompts(1, smoke.sizes.prompt_len, seed=51)[0]
    greedy = SamplingParams(max_new_tokens=smoke.sizes.new_tokens, temperature=0.0)
    tags = ["weights", "kv_cache"]

    async def run() -> dict[str, Any]:
        async with smoke.client() as client:
            before = await client.generate(prompt, greedy)
            free = smoke.device_free()
            start = time.perf_counter()
            await client.release_memory(tags)
            release_s = time.perf_counter() - start
            released = smoke.device_free()
            start = time.perf_counter()
            await client.resume_memory(tags)
            resume_s = time.perf_counter() - start
            resumed = smoke.device_free()
            after = await client.generate(prompt, greedy)
        return {
            "same": before.output_ids == after.output_ids,
            "freed": None if free is None else (released or 0) - free,
            "regained": None if released is None else released - (resumed or 0),
            "release_s": release_s,
            "resume_s": resume_s,
        }

    out = asyncio.run(run())
    r.figure(
        device_freed_bytes=out["freed"],
        device_regained_bytes=out["regained"],
        release_s=out["release_s"],
        resume_s=out["resume_s"],
    )
    r.check("same_greedy_output_after_resume", out["same"])
    summary = f"release {out['release_s']:.2f} s, resume {out['resume_s']:.2f} s"
    if out["freed"] is not None:
        weights = smoke.plan["engine_weights_bytes"] if smoke.plan else smoke.arch.num_parameters * 2
        r.figure(engine_weights_bytes=weights)
        r.check("weights_left_the_device", out["freed"] >= 0.9 * weights, _vs(out["freed"], weights))
        summary += f"; freed {_gib(out['freed'])} (weights {_gib(weights)})"
    r.summary = summary


SMOKE: list[Phase] = [
    Phase("environment", (), phase_environment),
    Phase("model", (), phase_model),
    Phase("plan", ("model_dir",), phase_plan),
    Phase("actor_vs_hf_fp32", ("model_dir",), phase_actor_vs_hf),
    Phase("train", ("model_dir",), phase_train),
    Phase("offload", ("actor",), phase_offload),
    Phase("engine_start", ("model_dir",), phase_engine_start),
    Phase("weight_sync", ("actor", "server"), phase_weight_sync),
    Phase("engine_requests", ("server",), phase_engine_requests),
    Phase("logprob_mismatch", ("actor", "server"), phase_logprob_mismatch),
    Phase("throughput", ("server",), phase_throughput),
    Phase("release_resume", ("server",), phase_release_resume),
]
MADE_BY = {"model_dir": "model", "actor": "train", "server": "engine_start"}
PHASE_NAMES = [p.name for p in SMOKE] + ["tests_gpu"]


def run_phase(smoke: Smoke, phase: Phase, budget_s: float) -> Record:
    """Run one phase; an exception becomes the record's error, a failed check its status."""
    r = Record(phase.name, budget_s=budget_s)
    missing = [need for need in phase.needs if getattr(smoke, need) is None]
    if missing:
        r.reason = "needs what " + ", ".join(sorted({MADE_BY[m] for m in missing})) + " did not make"
        return r
    start = time.perf_counter()
    try:
        phase.run(smoke, r)
        r.status = "passed" if all(c["ok"] for c in r.checks) else "failed"
    except Exception as e:  # recorded; the next phase runs
        r.status = "error"
        r.error = _error(e)
        logging.getLogger("gpu_check").exception("phase %s", phase.name)
    r.seconds = time.perf_counter() - start
    return r


def smoke_child(out: Any, device: str, work: str, log_path: str, engine_log: str) -> None:
    """The smoke process: runs every phase in order and reports each on `out` as ("start" | "done" | "end", ...)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    import torch

    from userrl_megatron.observability.noise import quiet_third_party

    quiet_third_party(on_gpu=torch.cuda.is_available())  # before megatron.core is imported (as each actor rank)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train
    sizes = SIZES[device]
    smoke = Smoke(device, sizes, Path(work), Path(engine_log))
    try:
        for phase in SMOKE:
            out.put(("start", phase.name, None))
            record = run_phase(smoke, phase, sizes.budget_s[phase.name])
            out.put(("done", phase.name, record.as_dict()))
    finally:
        smoke.close()
        out.put(("end", None, None))


def _build_actor(model: Any, smoke: Smoke) -> Any:
    """A `MegatronActor` as rank 0 of a world of one in this process (as tests/gpu and tests/distributed build it):
    `parallel.initialize` (NCCL on CUDA, gloo and the CPU support on CPU; again: a new layout, same group)."""
    from userrl_megatron.config.schema import AlgoConfig
    from userrl_megatron.megatron import parallel
    from userrl_megatron.megatron.actor import MegatronActor
    from userrl_megatron.megatron.launch import free_port

    if not smoke.port:
        smoke.port = free_port()
    parallel.initialize(smoke.megatron_config(), rank=0, world_size=1, master_port=smoke.port)
    return MegatronActor(model, smoke.megatron_config(), AlgoConfig(), seed=0)


def _batch(seqs: list[list[int]]) -> Any:
    from userrl_megatron.types import TrainBatch

    return TrainBatch(seqs, [], [])


def _hf_logprobs(model_dir: Path, seqs: list[list[int]], device: str) -> list[list[float]]:
    """transformers' per-token log-probs in fp32 on `device` (position 0 = 0.0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append([0.0, *logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()])
    del model
    return out


def _row_held(plan: Any, phase: str) -> dict[str, int]:
    rows = [row for row in plan.rows if row.phase == phase]
    return max(rows, key=lambda row: row.used).held if rows else {}


def _close(value: int, expected: int, tolerance: float) -> bool:
    return expected > 0 and abs(value - expected) <= tolerance * expected


def _vs(value: int | None, expected: int) -> str:
    return f"measured {value if value is None else f'{value:,}'} bytes, plan {expected:,}"


def _gib(nbytes: float | None) -> str:
    """Bytes as GiB with two decimals, or MiB below 0.1 GiB (the CPU run's sizes)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def _error(e: BaseException) -> dict[str, Any]:
    lines = "".join(traceback.format_exception(e)).rstrip().splitlines()
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback": lines[-12:]}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


# ---------------------------------------------------------------------------------------------------------------
# The driver: budgets, the smoke process, tests/gpu, the table and the JSON
# ---------------------------------------------------------------------------------------------------------------


class Clock:
    """The whole check's deadline."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def run_smoke(device: str, work: Path, paths: dict[str, Path], clock: Clock, report: Callable[[Record], None]) -> None:
    """Run the smoke process, enforcing each phase's budget and the deadline; `report` gets each record."""
    sizes = SIZES[device]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU check on a GPU machine stays on the CPU
    args = (out, device, str(work), str(paths["log"]), str(paths["engine_log"]))
    child = ctx.Process(target=smoke_child, args=args, daemon=False)
    child.start()
    if device == "cpu":
        _restore_env("CUDA_VISIBLE_DEVICES", env_before)
    done: set[str] = set()
    current: str | None = None
    started = time.monotonic()  # of the current phase, or of the last message between phases
    stopped = ""
    while True:
        try:
            kind, name, payload = out.get(timeout=1.0)
        except queue.Empty:
            if current is None and time.monotonic() - started > BETWEEN_PHASES_S:
                stopped = f"the smoke process said nothing for {BETWEEN_PHASES_S:.0f} s between phases"
            elif current is not None and time.monotonic() - started > sizes.budget_s[current]:
                stopped = f"{current} ran past its {sizes.budget_s[current]:.0f} s budget"
            elif current is not None and clock.left() <= 0:
                stopped = f"the check's {clock.total_s:.0f} s ran out during {current}"
            elif not child.is_alive():
                stopped = f"the smoke process died (exit code {child.exitcode})"
            else:
                continue
            _kill(child)
            if current is not None:
                r = Record(current, budget_s=sizes.budget_s[current], seconds=time.monotonic() - started)
                r.status = "timeout" if "budget" in stopped or "ran out" in stopped else "error"
                r.reason = stopped
                report(r)
                done.add(current)
            break
        if kind == "start":
            if clock.left() <= 0:  # no phase starts after the deadline
                stopped = "skipped: out of time"
                _kill(child)
                break
            current, started = name, time.monotonic()
        elif kind == "done":
            report(Record(**payload))
            done.add(name)
            current, started = None, time.monotonic()
        else:
            break
    child.join(timeout=60)
    if child.is_alive():
        _kill(child)
    for phase in SMOKE:
        if phase.name not in done:
            why = "out of time" if "out of time" in stopped or "ran out" in stopped else stopped or "not reported"
            report(Record(phase.name, budget_s=sizes.budget_s[phase.name], reason=f"skipped: {why}"))


def run_tests_gpu(device: str, paths: dict[str, Path], clock: Clock) -> Record:
    """`pytest tests/gpu` in a process of its own, within its budget and what is left of the check's."""
    budget = min(SIZES[device].budget_s["tests_gpu"], clock.left())
    r = Record("tests_gpu", budget_s=budget)
    if budget < 20:
        r.reason = "skipped: out of time"
        return r
    junit = paths["log"].with_suffix(".junit.xml")
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    env = {**os.environ}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    with open(paths["pytest_log"], "w") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = process.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    r.seconds = time.perf_counter() - start
    counts = _junit_counts(junit)
    with contextlib.suppress(OSError):
        junit.unlink()
    r.figure(exit_code=code, **counts)
    if code is None:
        r.status, r.reason = "timeout", f"pytest ran past {budget:.0f} s ({paths['pytest_log'].name} has its output)"
        return r
    r.check(
        "no_failures",
        counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0,
        ", ".join(counts.get("failures", [])),
    )
    r.check("pytest_exit_status", code in (0, 5) if counts.get("tests", 0) == 0 else code == 0, f"exit code {code}")
    r.status = "passed" if all(c["ok"] for c in r.checks) else "failed"
    r.summary = (
        f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
        f"{counts.get('skipped', 0)} skipped"
    )
    return r


def _junit_counts(path: Path) -> dict[str, Any]:
    """Counts and failing test ids from pytest's JUnit XML (empty if pytest wrote none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            failing.append(f"{case.get('classname')}::{case.get('name')}: {message}")
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failures": failing,
    }


def _kill(child: Any) -> None:
    with contextlib.suppress(ProcessLookupError, AttributeError):
        os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=10)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def format_table(records: list[Record]) -> str:
    """The table the check prints: one row per phase, then what failed."""
    lines = [f"{'phase':<18} {'status':<8} {'s':>6}  figures", "-" * 100]
    for r in records:
        text = r.summary or r.reason
        if r.error:
            text = f"{r.error['type']}: {r.error['message'].splitlines()[0] if r.error['message'] else ''}"[:160]
        lines.append(f"{r.name:<18} {r.status:<8} {r.seconds:>6.1f}  {text}")
        for c in r.checks:
            if not c["ok"]:
                lines.append(f"{'':<35}failed check {c['name']}: {c['detail']}")
    return "\n".join(lines)


def build_report(device: str, records: list[Record], wall_s: float, budget_s: float) -> dict[str, Any]:
    """The JSON document: environment, model, each phase, and a summary by status."""
    by_name = {r.name: r for r in records}
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    env = by_name.get("environment")
    model = by_name.get("model")
    return {
        "schema": SCHEMA_VERSION,
        "tool": "tools/gpu_check.py",
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall_s,
        "budget_s": budget_s,
        "environment": env.figures if env else {},
        "model": model.figures if model else {},
        "phases": {r.name: r.as_dict() for r in records},
        "summary": {"statuses": statuses, "all_passed": all(r.status == "passed" for r in records)},
    }


def render_markdown(document: dict[str, Any]) -> str:
    """A report's section for docs/gpu.md ("Reports"): device, date, versions, the table, then every figure."""
    env, phases = document["environment"], document["phases"]
    passed = sum(p["status"] == "passed" for p in phases.values())
    commit = (env.get("git_commit") or "")[:10] or "unknown commit"
    lines = [
        f"### {document['date'][:10]}, {env.get('device_name', document['device'])} ({commit})",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, megatron-core "
        f"{env.get('megatron_core')}, Python {env.get('python')}, driver {env.get('driver', '-')}; {passed} of "
        f"{len(phases)} phases passed in {document['wall_s']:.0f} s (budget {document['budget_s']:.0f} s).",
        "",
        "| phase | status | s | result |",
        "|---|---|---|---|",
    ]
    for name, p in phases.items():
        text = p["summary"] or p["reason"]
        if p["error"]:
            text = f"{p['error']['type']}: {p['error']['message'].splitlines()[0] if p['error']['message'] else ''}"
        failed = [f"failed check {c['name']}: {c['detail']}" for c in p["checks"] if not c["ok"]]
        cell = "; ".join([text[:300], *failed]).replace("|", "\\|")
        lines.append(f"| {name} | {p['status']} | {p['seconds']:.1f} | {cell} |")
    lines += ["", "Figures (bytes as GiB):", ""]
    for name, p in phases.items():
        if p["figures"] and name != "environment":
            shown = ", ".join(f"{k} {_figure(k, v)}" for k, v in p["figures"].items() if k not in ("layout", "url"))
            lines.append(f"- {name}: {shown}")
    return "\n".join(lines) + "\n"


def _figure(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int | float) and key.endswith("_bytes"):
        return f"{value / GIB:.3f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return "[" + ", ".join(_figure(key, v) for v in value[:8]) + (", ...]" if len(value) > 8 else "]")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_figure(key, v)}" for k, v in value.items()) + "}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: one GPU; cpu: the tiny CI run")
    p.add_argument("--out", default="runs/gpu_check/report.json", help="the JSON report (logs beside it)")
    p.add_argument("--budget-s", type=float, default=None, help="no phase starts after this (default 480 on cuda)")
    p.add_argument("--no-tests", action="store_true", help="skip tests/gpu")
    p.add_argument("--markdown", metavar="REPORT", help="print a report's section for docs/gpu.md and exit")
    args = p.parse_args(argv)
    if args.markdown:
        print(render_markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --device cpu runs the same phases on the CPU", file=sys.stderr)
        return 2
    sizes = SIZES[args.device]
    total_s = sizes.total_budget_s if args.budget_s is None else args.budget_s
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    paths = {
        "log": Path(f"{stem}.log"),
        "engine_log": Path(f"{stem}.engine.log"),
        "pytest_log": Path(f"{stem}.pytest.log"),
    }
    for path in paths.values():
        path.unlink(missing_ok=True)
    clock = Clock(total_s)
    records: list[Record] = []

    def report(r: Record) -> None:
        records.append(r)
        text = r.summary or r.reason or (r.error or {}).get("type", "")
        print(f"gpu_check: {r.name:<18} {r.status:<8} {r.seconds:6.1f} s  {text}", flush=True)

    # Every process the check starts (the smoke process, the engine server, pytest) imports the checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        run_smoke(args.device, work, paths, clock, report)
        if args.no_tests:
            report(Record("tests_gpu", budget_s=sizes.budget_s["tests_gpu"], reason="skipped: --no-tests"))
        else:
            report(run_tests_gpu(args.device, paths, clock))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - clock.start
    document = build_report(args.device, records, wall, total_s)
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print()
    print(format_table(records))
    print(f"\n{sum(r.status == 'passed' for r in records)} of {len(records)} phases passed in {wall:.0f} s; {out}")
    return 0 if document["summary"]["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
