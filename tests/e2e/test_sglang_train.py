"""`userrl train` through the real SGLang server (configs/sglang_cpu.yaml): 2 GRPO steps of SmolLM2-135M on CPU,
colocated (weights handed over as shared-memory handles through `/update_weights_from_tensor`) and disaggregated
with one-step-off partial rollouts (weights broadcast over gloo), the weights pushed to SGLang and read back after
every sync."""

import subprocess
from pathlib import Path

import pytest

from tests.support.tiny_run import REPO, RUN_TIMEOUT_S, train_command
from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON
from userrl_megatron.observability import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def run_through_sglang(tmp_path: Path, name: str, overrides: list[str]) -> list[dict]:
    """`userrl train` of configs/sglang_cpu.yaml plus `overrides`; the run's metrics after checking what every
    run through SGLang must show: two steps, the pushed weights read back exactly, the real server's log."""
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    command = ["--config", str(REPO / "configs" / "sglang_cpu.yaml"), f"run.output_dir={tmp_path}", f"run.name={name}"]
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as sink:
        code = subprocess.run(
            train_command([*command, *overrides]),
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
        )
    assert code.returncode == 0, "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sync/verify_max_rel_diff"] <= 1e-6 for r in records)  # SGLang holds exactly the pushed weights
    # SGLang's CPU kernels against Megatron's, on the steps whose tokens all came from the weights being trained: a
    # stale token (one-step-off) adds the last update's own change, as large as that update happened to be.
    on_policy = [r for r in records if r["rollout/staleness_max"] == 0.0]
    assert on_policy and all(r["mismatch/abs_logprob_diff"] < 1e-2 for r in on_policy)
    engine_log = tmp_path / name / "engines" / "engine_0.log"
    assert "SGLANG" in engine_log.read_text().upper()  # it was the real server, not the embedded one
    return records


def test_colocated_through_sglang(tmp_path: Path) -> None:
    """Colocated: the weights go to SGLang as shared-memory handles (no broadcast) after each synchronous step."""
    records = run_through_sglang(tmp_path, "colocated", ["rollout.colocate=true"])
    assert [r["train/weight_version"] for r in records] == [0, 1]
    assert [("sync/serialize_s" in r, "sync/broadcast_s" in r) for r in records] == [(True, False)] * 2


def test_disaggregated_one_step_off_with_partial_rollouts_through_sglang(tmp_path: Path) -> None:
    """Disaggregated: the weights are broadcast over gloo. Step 2's rollout runs on SGLang while step 1 trains;
    the push lands when training ends (SGLang's pause with abort: turns in flight are generated again on the
    new weights)."""
    overrides = ["rollout.colocate=false", "rollout.mode=one_step_off", "rollout.partial=true"]
    records = run_through_sglang(tmp_path, "async", overrides)
    assert [("sync/serialize_s" in r, "sync/broadcast_s" in r) for r in records] == [(False, True)] * 2
    assert records[0]["rollout/staleness_max"] == 0.0 and records[1]["rollout/staleness_max"] <= 1.0
    assert all(0.0 < r["tis/weight"] <= 2.0 for r in records)  # truncated IS on by default in this mode
