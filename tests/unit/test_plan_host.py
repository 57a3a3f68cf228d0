"""`userrl plan`'s host memory and weight-sync buckets against figures computed by hand (issue 27, item 6).

Pinned host buffers go through torch's caching host allocator, which rounds each block up to a power of two and
keeps it for the run; offload and the KL reference now take whole 256 MiB chunks, checkpoint staging one
buffer per tensor. A weight sync keeps two buckets alive on the device: the one in flight and the one being packed.
"""

import json
from pathlib import Path

import pytest

from userrl_megatron.cli import main
from userrl_megatron.config import load_config
from userrl_megatron.config.model_fit import PUBLISHED_SHAPES
from userrl_megatron.config.schema import MegatronConfig
from userrl_megatron.convert.arch import Architecture
from userrl_megatron.megatron.offload import HOST_CHUNK_BYTES
from userrl_megatron.plan import plan_problems, plan_run
from userrl_megatron.plan.memory import (
    EXPORT_GATHER_BYTES,
    HostMemory,
    RankTensors,
    export_working_set,
    host_memory,
    pinned_bytes,
    rank_tensors,
    staging_bytes,
    sync_buckets,
)
from userrl_megatron.plan.planner import HostRow

MIB = 2**20
# h 6, 2 heads of 3 (q 6), 1 KV head (kv 3), FFN 10, vocabulary 20, 2 layers, untied: 846 parameters
TINY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 3,
    "intermediate_size": 10,
    "vocab_size": 20,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}
ARCH = Architecture.from_hf_config(TINY)
# a layer: QKV 6 x (6 + 2 x 3) = 72, output projection 36, two norms of 6, gate/up 2 x 10 x 6 = 120, down 60
LAYER = [72, 36, 6, 6, 120, 60]
# bf16 bytes 144, 72, 12, 12, 240, 120 -> pinned 256, 128, 16, 16, 256, 128 = 800 a layer; embedding and output
# layer 240 -> 256 each, final norm 12 -> 16: 2 x 800 + 528 = 2128, an even share over DP2: 1064
WEIGHTS_STAGED = 1064
# fp32 master, exp_avg, exp_avg_sq of half of each tensor: 4 x 36 = 144 -> 256, 72 -> 128, 12 -> 16, 12 -> 16,
# 240 -> 256, 120 -> 128 (800 a layer); embedding and output layer 4 x 60 = 240 -> 256, norm 4 x 3 -> 16: 3 x 2128
OPTIMIZER_STAGED = 3 * 2128


def _config(tmp_path: Path, *overrides: str):
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY))
    yaml = tmp_path / "plan.yaml"
    yaml.write_text(
        f"model: {{path: {model}, dtype: bfloat16, max_context_length: 64}}\n"
        "megatron: {devices_per_node: 2, offload: true, micro_batch_tokens: 64}\n"
        "rollout: {backend: sglang, colocate: true, num_engines: 2, max_prompt_tokens: 32, max_response_tokens: 32, "
        "max_new_tokens_per_turn: 16}\n"
        "algo: {kl_coef: 0.1}\n"
        "checkpoint: {async_save: true}\n"
        "sync: {bucket_mb: 1}\n"
    )
    return yaml, load_config([str(yaml)], list(overrides))


def test_pinned_blocks_round_up_to_a_power_of_two() -> None:
    assert [pinned_bytes(n) for n in (0, 1, 3, 4096, 4097, 3 * 2**30)] == [0, 1, 4, 4096, 8192, 4 * 2**30]


def test_a_ranks_tensors_and_checkpoint_staging_by_hand() -> None:
    cfg = MegatronConfig()
    assert rank_tensors(ARCH, cfg) == RankTensors(LAYER * 2 + [120, 6, 120], [])
    assert sum(rank_tensors(ARCH, cfg).dense) == ARCH.num_parameters == 846
    assert staging_bytes(ARCH, cfg, "bfloat16", world=2, optimizer=False) == WEIGHTS_STAGED
    assert staging_bytes(ARCH, cfg, "bfloat16", world=2, optimizer=True) == WEIGHTS_STAGED + OPTIMIZER_STAGED
    assert host_memory(ARCH, cfg, "bfloat16", world=2, kl=True) == HostMemory(
        offload_weights=846 * 2,
        offload_state=846 * 12 // 2,  # Adam's moments and the fp32 master, over DP2
        reference=2 * HOST_CHUNK_BYTES,  # two copies of the weights, a chunk each
        staging=WEIGHTS_STAGED + OPTIMIZER_STAGED,
        staging_model_only=WEIGHTS_STAGED,
    )


def test_a_sync_keeps_two_buckets_of_at_least_its_two_largest_tensors() -> None:
    qwen32 = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-32b"])
    # the embedding and the untied LM head, 151,936 x 5,120 in bf16 each, outgrow 512 MiB buckets
    assert sync_buckets(qwen32, 512 * MIB, "bfloat16") == 2 * 151936 * 5120 * 2
    assert sync_buckets(qwen32, 2048 * MIB, "bfloat16") == 2 * 2048 * MIB
    assert sync_buckets(ARCH, MIB, "bfloat16") == 2 * MIB


def test_the_export_working_set_is_nothing_at_tp_1_and_one_gather_above() -> None:
    from userrl_megatron.megatron.export import GATHER_BATCH_BYTES

    assert EXPORT_GATHER_BYTES == GATHER_BATCH_BYTES
    qwen32 = Architecture.from_hf_config(PUBLISHED_SHAPES["qwen3-32b"])
    assert export_working_set(qwen32, 1, "bfloat16") == 0  # parameters are copied straight into the bucket
    embedding = 151936 * 5120 * 2  # the largest tensor: the rank's TP2 shard sent, the two shards gathered
    assert export_working_set(qwen32, 2, "bfloat16") == 3 * embedding // 2
    tiny = export_working_set(ARCH, 2, "bfloat16")
    assert tiny >= 3 * EXPORT_GATHER_BYTES  # small tensors still travel in 16 MiB gather batches


def test_the_plan_counts_each_nodes_pinned_memory(tmp_path: Path) -> None:
    _, cfg = _config(tmp_path)
    plan = plan_run(cfg)
    per_rank = {"offload": HOST_CHUNK_BYTES, "KL reference": 2 * HOST_CHUNK_BYTES}
    per_rank["checkpoint staging"] = WEIGHTS_STAGED + OPTIMIZER_STAGED
    both = {k: 2 * v for k, v in per_rank.items()}
    assert plan.host == [HostRow(0, 6 * HOST_CHUNK_BYTES + 2 * 7448, both, 2, 2)]
    assert WEIGHTS_STAGED + OPTIMIZER_STAGED == 7448
    sync = [r for r in plan.rows if r.phase == "weight sync"]
    assert [r.held["sync buckets (2)"] for r in sync] == [2 * MIB]
    one_per_node = plan_run(
        load_config([str(tmp_path / "plan.yaml")], ["megatron.nnodes=2", "megatron.devices_per_node=1"])
    ).host
    assert one_per_node == [HostRow(n, 3 * HOST_CHUNK_BYTES + 7448, per_rank, 1, 1) for n in (0, 1)]


def test_engine_weight_backups_count_when_the_weights_are_not_synced(tmp_path: Path) -> None:
    _, cfg = _config(tmp_path, "sync.enabled=false", "algo.kl_coef=0", "checkpoint.save_optimizer=false")
    # the model alone is staged; each engine GPU keeps its 846 x 2 bytes of weights while released
    held = {"offload": 2 * HOST_CHUNK_BYTES, "checkpoint staging": 2 * WEIGHTS_STAGED, "engine weight backup": 3384}
    assert plan_run(cfg).host == [HostRow(0, sum(held.values()), held, 2, 2)]


def test_the_broadcasts_buffers_stay_on_the_actors_gpus(tmp_path: Path) -> None:
    _, cfg = _config(tmp_path, "rollout.colocate=false", "megatron.offload=false", "algo.kl_coef=0")
    plan = plan_run(cfg)
    rows = {(r.phase, r.kind): r.held for r in plan.rows}
    assert rows[("weight sync", "actor")]["sync buckets (2)"] == 2 * MIB
    assert rows[("training", "actor")]["sync buckets (2)"] == 2 * MIB  # the second step trains beside them
    assert "sync buckets (2)" not in rows[("start-up", "actor")]
    assert plan.host == [
        HostRow(0, 2 * 7448, {"checkpoint staging": 2 * 7448}, 2, 0),
        HostRow(1, 0, {}, 0, 2),
    ]


def test_a_node_over_plan_host_memory_gb_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yaml, cfg = _config(tmp_path)
    assert plan_problems(plan_run(cfg)) == []
    code = main(["plan", "--config", str(yaml), "plan.host_memory_gb=1"])
    out, err = capsys.readouterr()
    assert code == 2
    assert (
        "node 0: 1.5 GiB (actor ranks 2, engine GPUs 2): KL reference 1.0, offload 0.5, checkpoint staging 0.0"
        in out.splitlines()
    )
    assert err.splitlines() == [
        "userrl: error: host memory: node 0 needs 1.5 GiB of pinned memory, 0.5 GiB more than plan.host_memory_gb = 1"
    ]
