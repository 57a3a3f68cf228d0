"""The GPU check's smoke sequence (`tools/gpu_check.py` runs it): what each phase builds, measures and checks on
one device, and the process that runs them in order (`smoke_child`). The phases are listed in gpu_check.py's
docstring; docs/gpu.md describes them."""

import gc
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu_simulator import phase_simulator_schema
from gpu_smoke import (
    GIB,
    SIZES,
    Phase,
    Record,
    Smoke,
    build_actor,
    close_to,
    dist_version,
    driver_version,
    error_record,
    gib,
    git_commit,
    hf_logprobs,
    live_at_peak,
    row_held,
    train_batch,
    vs_plan,
)


def phase_environment(smoke: Smoke, r: Record) -> None:
    import torch
    import transformers

    from userrl_megatron.megatron.cpu import stub_missing_kernels

    stub_missing_kernels()  # megatron.core importable without triton, as in every actor rank

    megatron_version = dist_version("megatron-core")
    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "megatron_core": megatron_version,
        "omegaconf": dist_version("omegaconf"),
        "cpu_count": os.cpu_count(),
        "device": smoke.device,
        "git_commit": git_commit(),
    }
    if smoke.cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / GIB, 2),
            multiprocessors=props.multi_processor_count,
            driver=driver_version(),
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
    training = row_held(plan, "training")
    actor_training = actor_share(training)
    engine = engine_memory(smoke.arch, cfg.rollout, cfg.model.dtype, cfg.plan)
    smoke.plan = {
        "training_bytes": sum(training.values()),
        "training_actor_bytes": actor_training,
        "actor_weights_bytes": training.get("actor weights", 0),
        "actor_grads_bytes": training.get("actor grads", 0),
        "actor_optimizer_bytes": training.get("actor optimizer", 0),
        "actor_activations_bytes": training.get("actor activations", 0),
        "actor_logits_bytes": training.get("actor logits", 0),
        "sync_buckets_bytes": row_held(plan, "weight sync").get("sync buckets (2)", 0),
        "sync_export_bytes": row_held(plan, "weight sync").get("export working set", 0),
        "engine_weights_bytes": engine.weights,
        "host_offload_bytes": sum(h.held.get("offload", 0) for h in plan.host),
    }
    r.figure(layout=overrides, phase_bytes=plan.phase_bytes(), **smoke.plan)
    r.check("plan_has_training", actor_training > 0)
    r.summary = (
        f"training peak {gib(plan.phase_bytes().get('training'))} of which actor {gib(actor_training)}; "
        f"weight sync {gib(plan.phase_bytes().get('weight sync'))}"
    )


def actor_share(training: dict[str, int]) -> int:
    """The actor's bytes of the plan's training phase (weights, grads, optimizer, activations, logits)."""
    return sum(v for k, v in training.items() if k.startswith("actor "))


def phase_actor_vs_hf(smoke: Smoke, r: Record) -> None:
    import torch

    from tests.support.distributed import max_abs_diff, random_sequences
    from userrl_megatron.config.schema import ModelConfig

    seqs = random_sequences(smoke.arch.vocab_size, list(smoke.sizes.logprob_lengths), seed=3)
    fp32 = build_actor(ModelConfig(path=str(smoke.model_dir)), smoke)
    try:
        actor = fp32.compute_logprobs(train_batch(seqs))
    finally:
        del fp32
        gc.collect()
    expected = hf_logprobs(smoke.model_dir, seqs, "cuda" if smoke.cuda else "cpu")
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
    if smoke.cuda:  # every allocation from here, with its Python stack: what the peak holds, by site
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    smoke.actor = build_actor(ModelConfig(path=str(smoke.model_dir), dtype=s.dtype), smoke)
    batch = bench_train.make_batch(smoke.arch.vocab_size, s.episodes, s.seq_len, seed=5)
    if smoke.cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = [smoke.actor.train_step(batch) for _ in range(2)]
    smoke.synchronize()
    if smoke.cuda:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        traced_peak, sites = live_at_peak(trace)
        r.figure(traced_peak_bytes=traced_peak, peak_by_site=[[n, site] for n, site in sites])
        steps.append(smoke.actor.train_step(batch))  # the step timed, without the recorder's stack captures
        smoke.synchronize()
        # RL batches change shape every step: a kernel that compiles per shape (cuDNN attention) shows here
        reshaped = bench_train.make_batch(smoke.arch.vocab_size, s.episodes, s.seq_len - 3, seed=6)
        r.figure(new_shape_step_s=smoke.actor.train_step(reshaped)["actor/step_time_s"])
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
                f"measured {gib(measured)}, plan {gib(predicted)}",
            )
            summary += f"; peak {gib(measured)}, plan {gib(predicted)}"
        else:
            r.check("plan_covers_training_peak", False, "no plan (the plan phase did not run)")
    r.summary = summary


def phase_offload(smoke: Smoke, r: Record) -> None:
    from userrl_megatron.megatron.offload import GRADS, STATE, WEIGHTS

    actor = smoke.actor
    probe = smoke.random_prompts(2, 32, seed=9)
    before_logprobs = actor.compute_logprobs(train_batch(probe))
    smoke.synchronize()
    before = smoke.allocated()
    actor.offload()
    after = smoke.allocated()
    parked: dict[str, int] = {}
    for kind, _, nbytes in actor.parking.parked.values():
        parked[kind] = parked.get(kind, 0) + nbytes
    host = actor.parking.arena.nbytes
    actor.onload()
    same = actor.compute_logprobs(train_batch(probe)) == before_logprobs
    r.figure(
        offloaded_weights_bytes=parked.get(WEIGHTS, 0),
        offloaded_grads_bytes=parked.get(GRADS, 0),
        offloaded_optimizer_bytes=parked.get(STATE, 0),
        host_arena_bytes=host,
        device_freed_bytes=None if before is None or after is None else before - after,
    )
    r.check("logprobs_bit_equal_after_onload", same)
    freed = sum(parked.values())
    summary = f"freed {gib(freed)}"
    if smoke.plan:
        plan = smoke.plan
        for kind, key in ((WEIGHTS, "actor_weights_bytes"), (GRADS, "actor_grads_bytes")):
            r.check(
                f"{key[:-6]}_as_planned",
                close_to(parked.get(kind, 0), plan[key], 0.02),
                vs_plan(parked.get(kind), plan[key]),
            )
        # The plan counts Adam's moments and the fp32 master copy; fp32 models have no separate master copy.
        r.check(
            "actor_optimizer_as_planned",
            close_to(parked.get(STATE, 0), plan["actor_optimizer_bytes"], 0.02),
            vs_plan(parked.get(STATE), plan["actor_optimizer_bytes"]),
        )
        predicted = plan["actor_weights_bytes"] + plan["actor_grads_bytes"] + plan["actor_optimizer_bytes"]
        r.figure(predicted_bytes=predicted, predicted_host_bytes=plan["host_offload_bytes"])
        if before is not None and after is not None:
            r.check(
                "device_memory_freed_as_planned",
                close_to(before - after, predicted, 0.05),
                vs_plan(before - after, predicted),
            )
        r.check("host_arena_as_planned", host == plan["host_offload_bytes"], vs_plan(host, plan["host_offload_bytes"]))
        summary += f", plan {gib(predicted)}; host {gib(host)}, plan {gib(plan['host_offload_bytes'])}"
    r.summary = summary


def phase_engine_start(smoke: Smoke, r: Record) -> None:
    from userrl_megatron.config.schema import EmbeddedServerConfig
    from userrl_megatron.fleet.launch import launch_embedded
    from userrl_megatron.ports import free_port

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
    r.summary = f"healthy after {seconds:.1f} s" + ("" if used is None else f", {gib(used)} on the device")


def push_actor(smoke: Smoke, version: int) -> dict[str, float]:
    """Push the actor's weights to the engine as the trainer does: what `MegatronWorker.connect_engines(...,
    "tensor")` sets up for the only rank of a world of one (handles to memory on its device, to the engine on the
    same device, names checked against the engine's checkpoint), then `export_hf_plans()` as `push_weights` does."""
    import torch

    from userrl_megatron.config.schema import SyncConfig
    from userrl_megatron.sync.sender import EngineEndpoint
    from userrl_megatron.sync.tensor_sender import TensorSender

    device = f"cuda:{torch.cuda.current_device()}" if smoke.cuda else "cpu"
    engine = EngineEndpoint(
        smoke.server.url, tp_size=1, first_device=0, checkpoint=str(smoke.model_dir), backend="embedded"
    )
    sender = TensorSender(SyncConfig(), [engine], f"gpu_check_v{version}", device)
    sender.connect()
    try:
        metrics = sender.push(smoke.actor.export_hf_plans(), version=version)
        smoke.synchronize()
        return metrics
    finally:
        sender.close()


def phase_weight_sync(smoke: Smoke, r: Record) -> None:
    import asyncio

    import torch
    from safetensors import safe_open

    rows = smoke.sizes.read_rows
    actor = smoke.actor
    expected = {name: t[:rows].detach().to("cpu", torch.float32).clone() for name, t in actor.export_hf_weights()}
    smoke.synchronize()
    before = smoke.allocated()
    if smoke.cuda:
        torch.cuda.reset_peak_memory_stats()
    metrics = push_actor(smoke, version=1)
    after = smoke.allocated()  # a GPU sender gives its segments back at the end of each push
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
        planned = smoke.plan["sync_buckets_bytes"] + smoke.plan["sync_export_bytes"]
        r.figure(measured_peak_bytes=peak, predicted_peak_bytes=planned)
        r.check("plan_covers_sync_peak", peak <= planned, vs_plan(peak, planned))
    sent = (metrics or {}).get("sync/bytes", 0.0)
    r.summary = (
        f"{len(expected)} tensors, {gib(sent)} in {(metrics or {}).get('sync/seconds', 0.0):.2f} s "
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
    """The trainer's colocated hand-off on the engine, which keeps no copy of its weights (as SGLang without
    `--enable-weights-cpu-backup`): every tag released for training (`MemoryHandoff.enter_training`), the weights
    resumed and pushed (`WeightSync.push`), the rest resumed (`enter_rollout`). Between the resume and the push the
    engine holds no weights and must refuse to generate."""
    import asyncio

    from userrl_megatron.trainer.handoff import MEMORY_TAGS
    from userrl_megatron.types import SamplingParams
    from userrl_megatron.wire.generation import EngineError

    prompt = smoke.random_prompts(1, smoke.sizes.prompt_len, seed=51)[0]
    greedy = SamplingParams(max_new_tokens=smoke.sizes.new_tokens, temperature=0.0)
    rest = [t for t in MEMORY_TAGS if t != "weights"]

    async def run() -> dict[str, Any]:
        async with smoke.client() as client:
            before = await client.generate(prompt, greedy)
            free = smoke.device_free()
            start = time.perf_counter()
            await client.release_memory(list(MEMORY_TAGS))
            release_s = time.perf_counter() - start
            released = smoke.device_free()
            start = time.perf_counter()
            await client.resume_memory(["weights"])
            resume_s = time.perf_counter() - start
            try:
                await client.generate(prompt, greedy)
                refused = ""
            except EngineError as e:
                refused = str(e)
            push = await asyncio.to_thread(push_actor, smoke, 2)
            await client.resume_memory(rest)
            resumed = smoke.device_free()
            after = await client.generate(prompt, greedy)
        return {
            "same": before.output_ids == after.output_ids,
            "refused": refused,
            "freed": None if free is None else (released or 0) - free,
            "regained": None if released is None else released - (resumed or 0),
            "release_s": release_s,
            "resume_s": resume_s,
            "push_s": push.get("sync/seconds", 0.0),
        }

    out = asyncio.run(run())
    r.figure(
        device_freed_bytes=out["freed"],
        device_regained_bytes=out["regained"],
        release_s=out["release_s"],
        resume_s=out["resume_s"],
        push_s=out["push_s"],
        refused=out["refused"][:120],
    )
    r.check("refused_before_the_push", "Cannot generate" in out["refused"], out["refused"][:120] or "it generated")
    r.check("same_greedy_output_after_the_push", out["same"])
    summary = f"release {out['release_s']:.2f} s, resume {out['resume_s']:.2f} s, push {out['push_s']:.2f} s"
    if out["freed"] is not None:
        weights = smoke.plan["engine_weights_bytes"] if smoke.plan else smoke.arch.num_parameters * 2
        r.figure(engine_weights_bytes=weights)
        r.check("weights_left_the_device", out["freed"] >= 0.9 * weights, vs_plan(out["freed"], weights))
        summary += f"; freed {gib(out['freed'])} (weights {gib(weights)})"
    r.summary = summary


def phase_train_largest(smoke: Smoke, r: Record) -> None:
    """The largest of `sizes.largest` whose training the plan fits in the device memory left once the engine and
    the smaller actor are gone, randomly initialised, trained in the phases' dtype: tokens/s and MFU."""
    import bench_train
    import torch

    from tests.support.tiny_models import tiny_config
    from userrl_megatron.config import load_config
    from userrl_megatron.config.schema import ModelConfig
    from userrl_megatron.plan import plan_run

    if smoke.server is not None:  # the last phase that needs it is done: its memory goes to the actor
        smoke.server.stop(timeout_s=60)
        smoke.server = None
    smoke.actor = None
    gc.collect()
    if smoke.cuda:
        torch.cuda.empty_cache()
    folders, planned = {}, {}
    for name, fields in smoke.sizes.largest:
        folders[name] = smoke.work / "largest" / name
        tiny_config("qwen3", **fields).save_pretrained(folders[name])  # config.json only: Megatron initialises
        cfg = load_config([], smoke.layout_overrides(folders[name]), command="gpu-check")
        planned[name] = actor_share(row_held(plan_run(cfg), "training"))
    free = smoke.device_free()
    name = largest_fitting(planned, free)
    r.figure(device_free_bytes=free, planned_actor_bytes=planned)
    if not r.check("a_candidate_fits", name is not None, f"free {gib(free)}, plans {planned}"):
        return
    folder, s = folders[name], smoke.sizes
    if smoke.cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = smoke.allocated()
    actor = build_actor(ModelConfig(path=str(folder), dtype=s.dtype), smoke, load_weights=False)
    try:
        batch = bench_train.make_batch(actor.arch.vocab_size, s.episodes, s.seq_len, seed=7)
        steps = [actor.train_step(batch) for _ in range(3)]  # the first one warms up
        smoke.synchronize()
        measured = torch.cuda.max_memory_allocated() - (baseline or 0) if smoke.cuda else None
        arch = actor.arch
    finally:
        del actor
        gc.collect()
    times = [m["actor/step_time_s"] for m in steps]
    step_s = statistics.median(times[1:])
    tokens = sum(len(t) for t in batch.token_ids)
    flops = bench_train.model_flops(arch, [len(t) for t in batch.token_ids])
    peak, peak_source = bench_train.gpu_peak(s.dtype) if smoke.cuda else (None, "no device peak on CPU")
    r.figure(
        model=name,
        parameters=arch.num_parameters,
        dtype=s.dtype,
        tokens_per_step=tokens,
        step_times_s=times,
        tokens_per_s=tokens / step_s,
        model_tflops_per_s=flops / step_s / 1e12,
        mfu=flops / step_s / peak if peak else None,
        peak_source=peak_source,
        measured_peak_bytes=measured,
    )
    r.check("finite_losses", all(math.isfinite(m["actor/loss"]) for m in steps))
    r.summary = f"{name}, {arch.num_parameters / 1e6:,.1f}M parameters, {s.dtype}: {tokens / step_s:,.0f} tokens/s"
    if peak:
        r.summary += f", MFU {flops / step_s / peak:.1%}"
    if measured is not None:
        r.check("plan_covers_training_peak", measured <= planned[name], vs_plan(measured, planned[name]))
        r.summary += f"; peak {gib(measured)}, plan {gib(planned[name])}"


LARGEST_SHARE_OF_FREE = 0.9  # the plan's actor share against the free device memory: room for the allocator's slack


def largest_fitting(planned: dict[str, int], free: int | None) -> str | None:
    """The last (largest) candidate whose planned bytes fit `LARGEST_SHARE_OF_FREE` of `free` (any, with no
    device memory to fit: the CPU)."""
    fitting = [name for name, nbytes in planned.items() if free is None or nbytes <= LARGEST_SHARE_OF_FREE * free]
    return fitting[-1] if fitting else None


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
    Phase("release_resume", ("actor", "server"), phase_release_resume),
    Phase("simulator_schema", (), phase_simulator_schema),
    Phase("train_largest", (), phase_train_largest),
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
        r.error = error_record(e)
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
