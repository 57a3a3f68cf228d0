"""Colocated mode end to end on CPU: around every update the engines pause and release their memory, the
actor onloads, the weights go to the engines' resumed weight memory (as shared-memory handles through
`/update_weights_from_tensor`, the CPU twin of CUDA IPC), then the actor offloads and the engines take their KV
cache back. Actor offload frees the actor's storage on CPU too (megatron/offload.py), and the
engine's release and hold are real, so a phase that used offloaded state would fail here.
The run also has a KL penalty to the initial policy, whose weights each rank swaps in for the reference pass."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import drill_env, tiny_run, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_colocated_run_syncs_verified_weights(tmp_path: Path) -> None:
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=2, tokenizer="char", num_hidden_layers=2)
    extra = [
        "rollout.colocate=true",
        "megatron.offload=true",
        "rollout.health_check_interval_s=0.2",  # a probe of a held engine would hang: the pool must be paused
        "sync.verify=true",
        "algo.kl_coef=0.05",
        # A save every step, inside the training window; an evaluation before training and after every step,
        # each a new best whose HF export waits for the next training window. Before the fix each save, export
        # and the run's start released the engines' weights and resumed them without a push: the strict engine
        # (as SGLang's memory saver) holds nothing after such a resume.
        "checkpoint.every_steps=1",
        "eval.before_training=true",
        "eval.every_steps=1",
        "eval.n_samples_per_prompt=1",
        "eval.max_tasks=2",
    ]
    # The engine dies as step 3's rollout starts: restarted, it gets weight version 2 from the offloaded actor (its
    # weights alone come back for the push) before it serves.
    records = train([*tiny_run(model, tmp_path, "colocated", 3), *extra], env=drill_env("kill_engine_in_rollout@3"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    before, records = records[0], records[1:]
    assert before["eval/infra_failed"] == 0 and before["eval/generated_tokens"] > 0
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)  # the engines hold the trainer's weights
    assert all(r["rollout/infra_failed"] == 0 and r["eval/infra_failed"] == 0 for r in records)
    assert "sync/verify_max_rel_diff" in records[0]  # the first push of the run is verified at its start
    assert all(r.get("sync/verify_max_rel_diff", 0.0) <= 1e-5 for r in records)
    assert [r["train/weight_version"] for r in records] == [0, 1, 2]
    assert [r["rollout/engine_restarts"] for r in records] == [0, 0, 1]
    # sync.method auto -> tensor: buckets handed to the engine as shared-memory handles, no process group.
    assert all("sync/serialize_s" in r and "sync/broadcast_s" not in r and r["sync/bytes"] > 0 for r in records)
    # Step 1 trains the initial policy: its KL to the reference is zero; after two updates it is not.
    assert records[0]["actor/kl_ref"] < 1e-7 < records[-1]["actor/kl_ref"]


def test_tp2_ranks_hand_the_engine_on_their_device_their_own_copy(tmp_path: Path) -> None:
    # 1,873,664 bytes of fp32 weights: two 1 MiB buckets per sync. TP=2 and an engine on each rank's device:
    # engine 1 maps rank 1's own copy of every bucket (the export all-gathers inside the TP group).
    shape = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512}
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=2, tokenizer="char", **shape)
    extra = [
        "rollout.colocate=true",
        "megatron.offload=true",
        "rollout.health_check_interval_s=0.2",
        "sync.verify=true",  # both engines read back after every sync
        "megatron.tensor_model_parallel_size=2",
        "megatron.devices_per_node=2",
        "rollout.num_engines=2",
        "sync.bucket_mb=1",
    ]
    # Engine 0 dies as step 2's rollout starts (a drill); the rollout finishes on engine 1, and entering training
    # waits for engine 0 to come back (it cannot release memory while it restarts) before both step aside.
    # Its own temporary directory (Ray's stays put): the run's register of shared segments is this test's alone.
    scratch = Path(tempfile.mkdtemp(prefix="seg"))  # short: torch's shared-memory manager puts a socket there
    try:
        records = train(
            [*tiny_run(model, tmp_path, "tp2", 2), *extra],
            env=drill_env(
                "kill_engine_in_rollout@2", base={**os.environ, "TMPDIR": str(scratch), "RAY_TMPDIR": "/tmp"}
            ),
        )
        registry = scratch / "userrl_segments"
        # Both ranks' senders registered their segments, and closed them before Ray killed the ranks.
        assert registry.is_dir() and sorted(registry.iterdir()) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert [r["rollout/engine_restarts"] for r in records] == [0, 1]
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 and r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)
    assert [(r["sync/bytes"], r["sync/buckets"], r["sync/handles_from_peers"]) for r in records] == [
        (1873664, 2, 2)
    ] * 2


def test_dp2_ranks_hand_the_engine_on_their_device_their_own_copy(tmp_path: Path) -> None:
    # TP=1 x DP=2 and an engine on each rank's device: engine 1 maps the copy of rank 1, data-parallel rank 1 (on a
    # multi-node layout the engines of the second node map the copies of its ranks, never one across nodes).
    shape = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512}
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=2, tokenizer="char", **shape)
    extra = [
        "rollout.colocate=true",
        "megatron.offload=true",
        "sync.verify=true",  # both engines read back after every sync
        "megatron.devices_per_node=2",
        "rollout.num_engines=2",
        "sync.bucket_mb=1",
    ]
    records = train([*tiny_run(model, tmp_path, "dp2", 2), *extra])
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 and r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)
    assert [(r["sync/bytes"], r["sync/buckets"], r["sync/handles_from_peers"]) for r in records] == [
        (1873664, 2, 2)
    ] * 2
