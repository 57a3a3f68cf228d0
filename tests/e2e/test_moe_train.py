"""A tiny Qwen3-MoE trains end to end on CPU through `userrl train`: two actor ranks with the experts split over
them (EP = 2), the embedded engine serving the MoE model and returning its routing, the trainer replaying it,
weight sync verified after every step, the load-balancing loss on."""

from pathlib import Path

import pytest

from tests.support.tiny_models import MOE_FAMILY, make_tiny_model
from tests.support.tiny_run import tiny_run, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_tiny_moe_trains_with_expert_parallelism_routing_replay_and_verified_sync(tmp_path: Path) -> None:
    model = make_tiny_model(MOE_FAMILY, tmp_path / "tiny_moe", seed=2, tokenizer="char", num_hidden_layers=2)
    extra = [
        "megatron.devices_per_node=2",
        "megatron.expert_model_parallel_size=2",
        "megatron.moe_aux_loss_coef=0.01",
        "algo.routing_replay=rollout",
        "sync.verify=true",
    ]
    records = train([*tiny_run(model, tmp_path, "moe", 3), *extra])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["train/weight_version"] for r in records] == [0, 1, 2]
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 for r in records)
    # every position but each episode's last token is routed as the engine routed it
    assert all(0.9 < r["actor/routing_replayed"] < 1.0 for r in records)
    # the engine (transformers' fused experts) and the trainer (Megatron's experts over 2 ranks) score the same
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)
    assert all(r["actor/moe_aux_loss"] > 0 and r["actor/update_ok"] == 1.0 for r in records)
    assert all(r["rollout/generated_tokens"] > 0 for r in records)
