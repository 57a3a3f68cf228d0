"""`userrl train` through the real SGLang server (configs/sglang_cpu.yaml), on the model families the GPU layouts
ship: a tiny random Qwen3 and Qwen3-MoE (the real Qwen3 tokenizer) beside SmolLM2-135M, 2 GRPO steps each on CPU,
colocated (weights handed over as shared-memory handles through `/update_weights_from_tensor`) and disaggregated
(weights broadcast over gloo, with one-step-off partial rollouts for SmolLM2).

SGLang 0.5.23 reads weights back by name for Llama only among these (`sglang/srt/models/qwen3.py` and
`qwen3_moe.py` define no `get_weights_by_name`): SmolLM2's pushes are read back exactly, the Qwen3 runs say once
that they cannot be, and every run's trainer/engine log-prob gap shows the engine computes with the trainer's
weights."""

import subprocess
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, train_command
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
UNREADABLE = "cannot read"  # the trainer's one warning for an engine whose model has no read-back by name


def run_through_sglang(tmp_path: Path, name: str, overrides: list[str], family: str = "smollm2") -> list[dict]:
    """`userrl train` of configs/sglang_cpu.yaml on `family` plus `overrides`; the run's metrics after checking
    what every run through SGLang must show: two steps, the engine's log-probs those of the trainer's weights,
    the pushed weights read back exactly where SGLang can, the real server's log."""
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    command = ["--config", str(REPO / "configs" / "sglang_cpu.yaml"), f"run.output_dir={tmp_path}", f"run.name={name}"]
    if family != "smollm2":
        model = make_tiny_model(family, tmp_path / family, seed=3, tokenizer="qwen3", initializer_range=0.3)
        command.append(f"model.path={model}")
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as sink:
        code = subprocess.run(
            train_command([*command, *overrides]),
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
        )
    output = log.read_text(errors="replace")
    assert code.returncode == 0, "\n".join(output.splitlines()[-60:])
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/infra_failed"] == 0 and r["rollout/generated_tokens"] > 0 for r in records)
    if family == "smollm2":  # SGLang holds exactly the pushed weights
        assert all(r["sync/verify_max_rel_diff"] <= 1e-6 for r in records) and UNREADABLE not in output
    else:  # the run's first push (at its start) is not read back, and says so once
        assert output.count(UNREADABLE) == 1 and not any("sync/verify_max_rel_diff" in r for r in records)
    # SGLang's CPU kernels against Megatron's, on the steps whose tokens all came from the weights being trained: a
    # stale token (one-step-off) adds the last update's own change, as large as that update happened to be.
    on_policy = [r for r in records if r["rollout/staleness_max"] == 0.0]
    assert on_policy and all(r["mismatch/abs_logprob_diff"] < 1e-2 for r in on_policy)
    engine_log = tmp_path / name / "engines" / "engine_0.log"
    assert "SGLANG" in engine_log.read_text().upper()  # it was the real server, not the embedded one
    return records


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_colocated_through_sglang(tmp_path: Path, family: str) -> None:
    """Colocated: the weights go to SGLang as shared-memory handles (no broadcast) at the run's start and after
    each synchronous step."""
    records = run_through_sglang(tmp_path, "colocated", ["rollout.colocate=true"], family)
    assert [r["train/weight_version"] for r in records] == [0, 1]
    assert [("sync/serialize_s" in r, "sync/broadcast_s" in r) for r in records] == [(True, False)] * 2
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)  # float32 on both sides


def test_disaggregated_through_sglang(tmp_path: Path) -> None:
    """Disaggregated, synchronous: the weights are broadcast over gloo to a Qwen3 engine."""
    records = run_through_sglang(tmp_path, "sync", ["rollout.colocate=false"], "qwen3")
    assert [("sync/serialize_s" in r, "sync/broadcast_s" in r) for r in records] == [(False, True)] * 2
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in records)


def test_disaggregated_one_step_off_with_partial_rollouts_through_sglang(tmp_path: Path) -> None:
    """Disaggregated: the weights are broadcast over gloo. Step 2's rollout runs on SGLang while step 1 trains;
    the push lands when training ends (SGLang's pause with abort: turns in flight are generated again on the
    new weights)."""
    overrides = ["rollout.colocate=false", "rollout.mode=one_step_off", "rollout.partial=true"]
    records = run_through_sglang(tmp_path, "async", overrides)
    assert [("sync/serialize_s" in r, "sync/broadcast_s" in r) for r in records] == [(False, True)] * 2
    assert records[0]["rollout/staleness_max"] == 0.0 and records[1]["rollout/staleness_max"] <= 1.0
    assert all(0.0 < r["tis/weight"] <= 2.0 for r in records)  # truncated IS on by default in this mode
