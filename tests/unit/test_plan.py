"""`userrl plan`: the memory arithmetic against hand-computed cases, and the trainer's choreography played on the
ledger: every shipped config plans clean, and each ordering mistake the choreography once made is caught."""

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from userrl_megatron.cli import main
from userrl_megatron.config import load_config
from userrl_megatron.config.model_fit import PUBLISHED_SHAPES
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.plan import format_plan, plan_problems, plan_run
from userrl_megatron.plan.ledger import Ledger, LedgerActors, LedgerPool, LedgerRunner
from userrl_megatron.plan.memory import (
    GIB,
    LOGIT_CHUNK_BYTES,
    actor_memory,
    engine_memory,
    layer_parameters,
    sglang_kv_pool,
)
from userrl_megatron.trainer import components, handoff
from userrl_megatron.trainer.weight_sync import WeightSync

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {
    path: REPO / "configs" / "model" / f"{path.name.split('-h')[0]}.yaml"
    for path in (REPO / "configs" / "layout").glob("*.yaml")
}
EXAMPLES = sorted((REPO / "examples").glob("*/config*.yaml"))  # a recipe and its variants (config-32b.yaml)


def test_layer_and_shard_sizes_by_hand() -> None:
    from userrl_megatron.megatron.logits import CHUNK_ELEMENTS

    tiny = Architecture.from_hf_config({**_tiny_config(), "model_type": "llama"})  # no q/k/v bias
    # attention 8 x (2x4 + 2x1x4) + 2x4 x 8 = 192, MLP 3 x 8 x 16 = 384, two norms 16
    assert layer_parameters(tiny) == 592
    te = MegatronConfig(tensor_model_parallel_size=2, micro_batch_tokens=64, transformer_impl="transformer_engine")
    m = actor_memory(tiny, te, "bfloat16", world=4)
    # per TP rank: 4 layers x (576 / 2 + 16 norm) + embedding 32 x 8 / 2 + final norm 8 + output layer 128 = 1480
    assert m.weights == 1480 * 2 and m.grads == 1480 * 4
    assert m.optimizer == 1480 * 12 // 2  # Adam moments + fp32 master, over DP = 4 / TP2 = 2
    # 64 tokens x (4h + 2q + 2kv + 3f = 104 values; the 4h = 32 norm values unsharded without SP) x 2 bytes
    assert m.train_activations == 4 * 64 * ((104 - 32) // 2 + 32) * 2
    assert m.forward_activations == 2 * 64 * 68 * 2
    # the local spec (also "auto") adds the rotated q and k (q + kv) and two more SwiGLU values (2f): 148 values
    local = dataclasses.replace(te, transformer_impl="auto")
    assert actor_memory(tiny, local, "bfloat16", world=4).train_activations == 4 * 64 * ((148 - 32) // 2 + 32) * 2
    # the logits (64 tokens x 16 local columns x 2 bytes), in training their gradient too, and one fp32 chunk
    assert m.train_logits == 2 * 64 * 16 * 2 + LOGIT_CHUNK_BYTES and m.forward_logits == 64 * 16 * 2 + LOGIT_CHUNK_BYTES
    assert LOGIT_CHUNK_BYTES == 3 * 4 * CHUNK_ELEMENTS  # the chunk megatron/logits.py works in
    sp_full = dataclasses.replace(te, sequence_parallel=True, recompute="full")
    # full recompute keeps each layer's input (64 x 8 / 2 values) and one layer's set (64 x 52 values)
    assert actor_memory(tiny, sp_full, "bfloat16", world=4).train_activations == (4 * 64 * 4 + 64 * 52) * 2
    selective = dataclasses.replace(te, recompute="selective", recompute_modules=["mlp", "layernorm"])
    # "mlp" and "layernorm" recomputed: 2h norm inputs (unsharded) + 2q + 2kv = 40 values, 24 of them over TP2
    assert actor_memory(tiny, selective, "bfloat16", world=4).train_activations == 4 * 64 * (24 // 2 + 16) * 2
    block = dataclasses.replace(sp_full, recompute_num_layers=1)
    # the first layer of the stage keeps only its input, the other three everything, plus the recomputed one
    assert actor_memory(tiny, block, "bfloat16", world=4).train_activations == (64 * 4 + 3 * 64 * 52 + 64 * 52) * 2
    pp2 = MegatronConfig(
        pipeline_model_parallel_size=2,
        use_distributed_optimizer=False,
        micro_batch_tokens=64,
        transformer_impl="transformer_engine",
    )
    # the last stage (2 layers, final norm, output layer) is the larger; 2 micro-batches in flight under 1F1B
    assert actor_memory(tiny, pp2, "bfloat16", world=2).weights == (2 * 592 + 8 + 256) * 2
    assert actor_memory(tiny, pp2, "bfloat16", world=2).train_activations == 2 * 2 * 64 * 104 * 2


def _tiny_config() -> dict:
    return {
        "num_hidden_layers": 4,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "intermediate_size": 16,
        "vocab_size": 32,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
    }


def test_engine_sizes_match_published_qwen3_8b_figures() -> None:
    arch = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-8b"])
    cfg = load_config(overrides=["rollout.backend=sglang"])
    engine = engine_memory(arch, cfg.rollout, "bfloat16", cfg.plan)
    assert round(arch.num_parameters / 1e9, 2) == 8.19  # Qwen3-8B: 8.2B parameters
    assert engine.kv_token == 2 * 36 * 8 * 128 * 2 == 144 * 1024  # K and V, 36 layers, 8 KV heads of 128, bf16
    assert engine.weights == arch.num_parameters * 2
    # SGLang keeps (1 - mem_fraction_static) of the device outside its pool: 50 GiB free, 80 GiB, 0.5 -> 10 GiB
    assert sglang_kv_pool(50 * GIB, 80 * GIB, 0.5) == 10 * GIB


def _layout(path: Path, *overrides: str):
    return load_config([str(LAYOUTS[path]), str(path)], list(overrides))


@pytest.mark.parametrize("path", sorted(LAYOUTS), ids=lambda p: p.name)
def test_every_layout_plans_clean(path: Path) -> None:
    plan = plan_run(_layout(path))
    assert plan_problems(plan) == []
    # the actor's weights go to the engines before the first rollout (colocated: into their released memory)
    assert [r.phase for r in plan.rows][:3] == ["start-up", "weight sync", "rollout"] and min(plan.kv_tokens) > 0


@pytest.mark.parametrize(
    "path", [*EXAMPLES, REPO / "configs" / "quickstart.yaml"], ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_every_example_plans_clean(path: Path) -> None:
    assert plan_problems(plan_run(load_config([str(path)]))) == []


H100_8B = REPO / "configs" / "layout" / "qwen3-8b-h100x8.yaml"
H100_32B = REPO / "configs" / "layout" / "qwen3-32b-h100x16.yaml"
H100_32B_USERSIM = REPO / "configs" / "layout" / "qwen3-32b-h100x24-usersim.yaml"
H100_32B_SHARED = REPO / "configs" / "layout" / "qwen3-32b-h100x16-usersim-shared.yaml"
H100_30B = REPO / "configs" / "layout" / "qwen3-30b-a3b-h100x8.yaml"
QWEN3_8B = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-8b"])
KV_TOKEN_8B = 2 * 36 * 8 * 128 * 2  # K and V of 36 layers, 8 KV heads of 128, bf16: one TP1 engine GPU


def test_engines_starting_beside_a_resident_actor_get_no_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started beside the actor's resident state, an engine keeps the pool it sized then: the 8B layout's engines a
    quarter of theirs, the 30B-A3B H100 layout's none (SGLang refuses to start)."""
    fitting = plan_run(_layout(H100_8B)).kv_tokens

    async def engines_first(parts: components.Components) -> None:  # the start-up order before the fix
        await parts.pool.start()
        await parts.weights.connect()

    monkeypatch.setattr(components, "bring_up", engines_first)
    beside = plan_run(_layout(H100_8B))
    assert beside.kv_tokens == [beside.restarts["engine"].kv_tokens] * 8 and beside.kv_tokens[0] < fitting[0] // 3
    problems = plan_problems(plan_run(_layout(H100_30B)))
    assert any("engine 0 starts with" in p and "no room for a KV cache" in p for p in problems), problems


def test_sync_frees_grads_and_optimizer_before_engine_weights_return(monkeypatch: pytest.MonkeyPatch) -> None:
    # TP2 engines (the layout's first version) on 70 GiB: the old order needed their 30.5 GiB of weights back
    # beside the actor's grads and optimizer state (78.8 GiB when the plan counted one 512 MiB sync bucket; the
    # two live buckets hold the embedding and the LM head, 1.45 GiB each: 81.2 GiB; the export's TP gather of the
    # embedding's shards beside them: 82.8 GiB; the CUDA-graph pool SGLang keeps through training: 85.8 GiB).
    cfg = _layout(H100_32B, "plan.device_memory_gb=70", "rollout.engine_tp=2", "rollout.num_engines=8")
    assert plan_problems(plan_run(cfg)) == []
    offload = LedgerActors.offload

    def weights_only(self: LedgerActors, weights: bool = True) -> None:  # the sync before the fix frees nothing
        if weights:
            offload(self, weights)

    monkeypatch.setattr(LedgerActors, "offload", weights_only)
    problems = plan_problems(plan_run(cfg))
    assert problems and problems[0].startswith("weight sync: GPU 0 needs 85.8 GiB, 15.8 GiB more than"), problems


def test_the_first_push_onloads_the_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.asynccontextmanager
    async def as_it_is(self: handoff.MemoryHandoff) -> AsyncIterator[None]:  # before the fix: no onload
        yield

    monkeypatch.setattr(handoff.MemoryHandoff, "actor_on_device", as_it_is)
    problems = plan_problems(plan_run(_layout(H100_8B, "eval.every_steps=1")))
    assert problems == ["a weight export runs while the actor weights are offloaded (it would crash)"]


def test_saves_and_exports_run_in_the_training_window() -> None:
    """Checkpoints and best-model exports read the actor while it holds the GPUs for its update: no hand-off of
    their own, so no weights released and resumed around them."""
    plan = plan_run(_layout(H100_8B, "eval.every_steps=1", "checkpoint.every_steps=1", "eval.before_training=true"))
    assert plan_problems(plan) == []
    phases = [r.phase for r in plan.rows]
    assert {"checkpoint", "HF export"} <= set(phases)


def test_a_rollout_over_weights_nobody_refilled_fails_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer before the fix: no push at the start of a fresh run, no push when the hand-off gives released
    weights back. SGLang's resume maps fresh memory (`managers/scheduler_components/weight_updater.py:383-403` of
    0.5.23: `memory_saver_adapter.resume(weights)`, no reload unless `--enable-weights-cpu-backup`)."""

    async def no_refill(self: handoff.MemoryHandoff) -> None:
        return None

    push = WeightSync.push

    async def not_at_step_0(self: WeightSync, version: int) -> dict[str, float]:
        return {} if version == 0 else await push(self, version)

    monkeypatch.setattr(handoff.MemoryHandoff, "_refill", no_refill)
    monkeypatch.setattr(WeightSync, "push", not_at_step_0)
    problems = plan_problems(plan_run(_layout(H100_8B, "eval.before_training=true")))
    assert problems[0] == (
        "the evaluation runs on engine-0, whose weights were released without a host copy and not pushed since (it "
        "would generate from garbage)"
    )
    assert plan_problems(plan_run(_layout(H100_8B, "rollout.sglang.enable_weights_cpu_backup=true"))) == []


def test_the_ledger_marks_released_weights_until_a_push() -> None:
    cfg, arch = _layout(H100_8B), Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-8b"])
    ledger = Ledger.of(2, 80 * GIB)
    pool = LedgerPool(ledger, engine_memory(arch, cfg.rollout, "bfloat16", cfg.plan), cfg.rollout, [[0], [1]])
    actors = LedgerActors(ledger, actor_memory(arch, cfg.megatron, "bfloat16", 2), [0, 1], 2**20)
    runner = LedgerRunner(ledger, 16)

    async def go() -> None:
        groups = actors.connect_engines([{"url": "engine-1"}], "g", "tensor")
        for client in pool.clients:
            await client.release_memory(["weights"])
            await client.resume_memory(["weights"])
        actors.push_weights(groups, 1)  # reaches engine 1 only
        await runner.run_groups([], 1, None)

    asyncio.run(go())
    assert ledger.problems == [
        "the rollout runs on engine-0, whose weights were released without a host copy and not pushed since (it "
        "would generate from garbage)"
    ]


def test_the_log_prob_pass_is_planned_only_when_it_runs() -> None:
    quickstart = str(REPO / "configs" / "quickstart.yaml")
    on_policy = ["algo.kl_coef=0"]  # one optimizer step per RL step and no reference model: no scoring pass
    assert "log-probs" not in {r.phase for r in plan_run(load_config([quickstart], on_policy)).rows}
    for scored in (["algo.kl_coef=0", "algo.ppo_epochs=2"], []):  # old log-probs; reference log-probs (KL)
        assert "log-probs" in {r.phase for r in plan_run(load_config([quickstart], scored)).rows}


def test_cli_names_the_phase_and_the_shortfall(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--config", str(REPO / "configs" / "quickstart.yaml"), "plan.device_memory_gb=7"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "peak: 8.0 GiB on GPU 1 during start-up" in out
    assert (
        err.splitlines()[0]
        == "userrl: error: start-up: GPU 1 needs 8.0 GiB, 1.0 GiB more than plan.device_memory_gb = 7"
    )


def test_the_user_simulators_engines_are_planned_on_gpus_of_their_own() -> None:
    cfg = _layout(H100_32B, "user_sim.engines.model=qwen3-32b", "user_sim.engines.engine_tp=4")
    plan = plan_run(cfg)
    [row] = plan.simulator
    assert (row.phase, row.kind) == ("serving", "user sim")
    assert round(row.held["engine weights"] / 2**30, 1) == 15.3  # Qwen3-32B in bf16 over 4 GPUs
    assert row.used <= plan.device_bytes and len(plan.simulator_kv_tokens) == 1 and plan.simulator_kv_tokens[0] > 0
    assert "user simulator: 1 engine(s) TP4 of qwen3-32b on GPUs of their own (4 more)" in format_plan(plan, cfg)
    assert plan_run(_layout(H100_32B)).simulator == []  # none unless the run serves the simulator
    small = _layout(H100_32B, "user_sim.engines.model=qwen3-32b", "user_sim.engines.engine_tp=1")
    problems = plan_problems(plan_run(small))  # 32B on one GPU: no room left for its KV cache
    assert any(p.startswith("user simulator: engine 0 starts with") and "no room for a KV cache" in p for p in problems)


def test_the_usersim_layout_serves_the_simulator_on_a_node_of_its_own() -> None:
    """Four TP2 engines of Qwen3-32B at 0.85 of each GPU (user_sim.engines.mem_fraction_static) beside the 32B
    policy's two nodes; the last line gives the whole run's nodes."""
    cfg = load_config([str(H100_32B_USERSIM)])
    plan = plan_run(cfg)
    assert plan_problems(plan) == [] and plan.devices == 16
    [row] = plan.simulator
    device = int(79.6 * GIB)
    weights = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-32b"]).num_parameters * 2 // 2
    free = device - GIB  # its CUDA context: SGLang keeps 0.15 of what is free then outside its pool
    kv = free - weights - int(free * (1 - 0.85))
    assert row.held == {
        "CUDA contexts": GIB,
        "engine weights": weights,
        "engine KV cache": kv,
        "engine runtime": 3 * GIB,
    }
    assert plan.simulator_kv_tokens == [kv // (2 * 64 * 4 * 128 * 2)] * 4 == [297_352] * 4  # 4 of 8 KV heads a GPU
    lines = format_plan(plan, cfg).splitlines()
    assert lines[-2:] == [
        "user simulator: 4 engine(s) TP2 of /models/Qwen3-32B on GPUs of their own (8 more): 70.8 GiB per GPU "
        "(engine KV cache 36.3, engine weights 30.5, engine runtime 3.0, CUDA contexts 1.0); KV cache 297,352 tokens "
        "per engine",
        "the run takes 3 nodes of 8 GPUs (megatron.devices_per_node): 24 GPUs, 16 for the actor and the policy's "
        "engines and 8 for the user simulator's engines",
    ]
    alone = _layout(H100_32B)
    assert format_plan(plan_run(alone), alone).splitlines()[-1] == (
        "the run takes 2 nodes of 8 GPUs (megatron.devices_per_node): 16 GPUs"
    )
    at_policy_fraction = plan_run(load_config([str(H100_32B_USERSIM)], ["user_sim.engines.mem_fraction_static=0"]))
    assert at_policy_fraction.simulator[0].held["engine KV cache"] == free - weights - int(free * (1 - 0.6))


def test_the_shared_layout_serves_the_simulator_on_the_policy_engines_gpus() -> None:
    """Four TP4 simulator engines on the four policy engines' GPUs (user_sim.engines.placement: policy_engines): they
    start first, with 0.3 of what is free; the policy's engines start after the actor's offload, SGLang told 0.8
    (both shares) of what is free then; while the actor trains the simulator keeps its weights and both sides'
    CUDA-graph pools wait in host memory (`rollout.sglang.release_cuda_graph`); no GPU added."""
    cfg = load_config([str(H100_32B_SHARED)])
    plan = plan_run(cfg)
    assert plan_problems(plan) == [] and plan.devices == 16 and plan.simulator == []
    device = int(79.6 * GIB)
    weights = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-32b"]).num_parameters * 2 // 4
    contexts = 3 * GIB  # the actor rank's, the policy engine's and the simulator engine's
    free = device - contexts
    sim_kv = free - weights - int(free * (1 - 0.3))
    kv_token = 2 * 64 * 2 * 128 * 2  # 2 of 8 KV heads a GPU
    assert plan.simulator_kv_tokens == [sim_kv // kv_token] * 4 == [126_549] * 4
    sim = {"user sim weights": weights, "user sim KV cache": sim_kv, "user sim runtime": 3 * GIB}
    assert plan.simulator_shared == sim | {"CUDA contexts": GIB}
    policy_free = free - sum(sim.values())
    policy_kv = policy_free - weights - int(policy_free * (1 - 0.8))
    assert plan.kv_tokens == [policy_kv // kv_token] * 4 == [413_531] * 4
    rows = {row.phase: row for row in plan.rows}
    assert set(rows) == {"start-up", "rollout", "training", "weight sync", "checkpoint", "HF export"}
    assert {row.kind for row in plan.rows} == {"shared"}
    policy = {"engine weights": weights, "engine KV cache": policy_kv, "engine runtime": 3 * GIB}
    assert rows["rollout"].held == sim | policy | {"CUDA contexts": contexts}
    held = rows["training"].held  # both sides' KV caches and CUDA-graph pools released, the simulator's weights kept
    assert held["user sim weights"] == weights
    assert not {"user sim KV cache", "user sim runtime", "engine KV cache", "engine runtime"} & set(held)
    assert plan.host[0].held["engine CUDA graph backup"] == 8 * (3 + 3) * GIB  # each GPU backs up both pools
    kept = plan_run(load_config([str(H100_32B_SHARED)], ["rollout.sglang.release_cuda_graph=false"]))
    kept_rows = {row.phase: row for row in kept.rows}
    assert kept_rows["training"].held["user sim runtime"] == kept_rows["training"].held["engine runtime"] == 3 * GIB
    assert "engine CUDA graph backup" not in kept.host[0].held
    # start-up binds, 4.8 GiB under the GPU; with the graph pools kept training would, at 76.4 (3.2 free)
    assert {p: round(r.used / GIB, 1) for p, r in rows.items() if p in ("start-up", "rollout", "training")} == {
        "start-up": 74.8, "rollout": 72.5, "training": 70.4
    }  # fmt: skip
    assert round(kept_rows["training"].used / GIB, 1) == 76.4
    assert {"user sim KV cache", "actor optimizer"} <= set(rows["start-up"].held)  # the actor loads beside them
    lines = format_plan(plan, cfg).splitlines()
    assert lines[-2:] == [
        "user simulator: 4 engine(s) TP4 of /models/Qwen3-32B on the policy engines' GPUs (no more GPUs): 27.0 GiB "
        "per GPU while serving (user sim weights 15.3, user sim KV cache 7.7, user sim runtime 3.0, CUDA contexts "
        "1.0); KV cache 126,549 tokens per engine",
        "the run takes 2 nodes of 8 GPUs (megatron.devices_per_node): 16 GPUs",
    ]
    even = plan_run(
        load_config(
            [str(H100_32B_SHARED)],
            ["rollout.sglang.mem_fraction_static=0.4", "user_sim.engines.mem_fraction_static=0.4"],
        )
    )
    assert plan_problems(even) == ["start-up: GPU 0 needs 82.4 GiB, 2.8 GiB more than plan.device_memory_gb = 79.6"]


def test_an_embedded_engine_holds_no_request_beyond_its_context_length() -> None:
    """The embedded engine's KV: max_running_requests requests of the episode budget (1,024 + 1,024 tokens), each
    at most `context_length`, plus the prefix cache."""
    base = ["user_sim.engines.model=qwen3-32b", "user_sim.engines.engine_tp=4", "user_sim.engines.backend=embedded"]
    assert plan_run(_layout(H100_32B, *base)).simulator_kv_tokens == [64 * 2048 + 16384]
    short = plan_run(_layout(H100_32B, *base, "user_sim.engines.context_length=1024"))
    assert short.simulator_kv_tokens == [64 * 1024 + 16384]


def test_plan_refuses_tensor_handles_to_a_gpu_the_engine_cannot_see(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 55, item 3: the 8B layout's engines on a second node, handed tensor handles to rank 0's memory."""
    code = main(["plan", "--config", str(H100_8B), "rollout.colocate=false", "sync.method=tensor"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("userrl: error: sync.method = tensor hands engine 0 a CUDA IPC handle")


def test_sglang_sizes_its_kv_pool_from_the_memory_free_at_its_start() -> None:
    """SGLang 0.5.23 keeps (1 - mem_fraction_static) of the memory free before it loads its weights, not of the
    device: `pre_model_load_memory` is measured once torch.distributed is up, before the weights
    (model_executor/model_runner.py:1261-1264, distributed/bootstrap.py:193-223, the minimum over the engine's TP
    ranks), and the pool gets what is free after the weights less `pre_model_load_memory x (1 - fraction)`
    (mem_cache/kv_cache_configurator.py:3007, 3038). The 8B layout's engine starts beside the actor rank's CUDA
    context and its own: 77.6 GiB free of 79.6."""
    assert sglang_kv_pool(50 * GIB, 70 * GIB, 0.5) == 15 * GIB  # 70 GiB free at start: 35 kept outside the pool
    plan = plan_run(_layout(H100_8B))
    free = int(79.6 * GIB) - 2 * GIB
    weights = QWEN3_8B.num_parameters * 2
    kv = free - weights - int(free * (1 - 0.5))
    assert plan.kv_tokens == [kv // KV_TOKEN_8B] * 8 == [171_439] * 8


def test_sglang_keeps_its_cuda_graph_pool_through_training_unless_its_environment_frees_it() -> None:
    """SGLang 0.5.23 captures its CUDA graphs in the memory saver's region, which a release of "cuda_graph" frees,
    only with `SGLANG_MEMORY_SAVER_CUDA_GRAPH` set (model_executor/runner_backend/full_cuda_graph_backend.py:121-124,
    185-195); otherwise the release frees nothing (managers/scheduler_components/weight_updater.py:376-377 pauses
    an empty region) and the pool stays beside the training actor. `rollout.sglang.release_cuda_graph` sets it, as
    slime does, and then the pool is backed up in host memory while released (`enable_cpu_backup=True`)."""
    kept = {row.phase: row for row in plan_run(_layout(H100_8B)).rows}
    assert kept["training"].held["engine runtime"] == 3 * GIB
    assert kept["checkpoint"].held["engine runtime"] == 3 * GIB
    released = plan_run(_layout(H100_8B, "rollout.sglang.release_cuda_graph=true"))
    assert "engine runtime" not in {row.phase: row for row in released.rows}["training"].held
    assert released.host[0].held["engine CUDA graph backup"] == 8 * 3 * GIB
    disaggregated = _layout(H100_8B, "rollout.colocate=false", "megatron.offload=false")
    assert "engine CUDA graph backup" not in plan_run(disaggregated).host[0].held  # nothing released


def test_an_engine_restarted_inside_the_push_sizes_its_kv_cache_beside_the_actors_weights_only() -> None:
    """The weight sync first restarts dead engines (trainer/weight_sync.py, `repair_engines` in `push`). An engine
    restarted there measures its free memory beside what the actor holds and keeps that pool for its life, so the
    actor's grads and optimizer state leave first (colocated with megatron.offload); before, it kept a third of
    the pool it started with (46,453 KV tokens on this layout)."""
    cfg = _layout(H100_8B)
    plan = plan_run(cfg)
    actor = actor_memory(QWEN3_8B, cfg.megatron, "bfloat16", world=8)
    free = int(79.6 * GIB) - 2 * GIB - actor.weights  # the actor rank's and the new engine's CUDA contexts
    kv = free - QWEN3_8B.num_parameters * 2 - int(free * (1 - 0.5))
    restart = plan.restarts["engine"]  # after the phase the trainer recorded last before the push (its order's)
    assert (restart.free, restart.kv_tokens) == (free, kv // KV_TOKEN_8B) and restart.after in plan.phase_bytes()
    assert min(plan.kv_tokens) * 3 // 4 < restart.kv_tokens < min(plan.kv_tokens)
    line = f"an engine restarted after {restart.after} gets {kv // KV_TOKEN_8B:,} KV tokens (70.0 GiB free before"
    assert line in format_plan(plan, cfg)
