"""Colocated mode end to end on CPU: around every update the engines pause and release their memory, the
actor onloads, the weights go to the engines' resumed weight memory, then the actor offloads and the engines
take their KV cache back. (Actor offload moves nothing on CPU; the engine's release and hold are real.)
The run also has a KL penalty to the initial policy, whose weights each rank swaps in for the reference pass."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_colocated_run_syncs_verified_weights(tmp_path: Path) -> None:
    model = make_tiny_model("qwen3", tmp_path / "tiny", seed=2, tokenizer="char", num_hidden_layers=2)
    overrides = [
        f"model.path={model}",
        f"run.output_dir={tmp_path}",
        "run.name=colocated",
        "run.total_steps=3",
        "model.tool_format=tags",
        "model.max_context_length=512",
        "megatron.micro_batch_tokens=4096",
        "megatron.lr=1.0e-3",
        "rollout.colocate=true",
        "megatron.offload=true",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_turns=2",
        "rollout.max_prompt_tokens=128",
        "rollout.max_response_tokens=128",
        "rollout.max_new_tokens_per_turn=8",
        "rollout.health_check_interval_s=0.2",  # a probe of a held engine would hang: the pool must be paused
        "gyms.train=[echo-procedural]",
        "sync.verify=true",
        "algo.kl_coef=0.05",
        "checkpoint.every_steps=0",
        "checkpoint.save_hf=false",
        "logging.backends=[]",
    ]
    subprocess.run([sys.executable, "-m", "userrl_megatron", "train", *overrides], cwd=REPO, check=True, timeout=600)
    records = [json.loads(line) for line in (tmp_path / "colocated" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["sync/verify_max_rel_diff"] <= 1e-5 and r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)
    assert [r["train/weight_version"] for r in records] == [0, 1, 2]
    # Step 1 trains the initial policy: its KL to the reference is zero; after two updates it is not.
    assert records[0]["actor/kl_ref"] < 1e-7 < records[-1]["actor/kl_ref"]
