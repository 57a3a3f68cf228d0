"""tools/gpu_check.py (`make gpu-check`) on the CPU: every phase of the GPU check passes at its CPU size and writes
the figures docs/gpu.md reports, so the script cannot rot between GPU runs; a raising phase is recorded and the
next one runs; a check out of time skips what is left, naming why."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(out: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_every_phase_passes_on_the_cpu_and_reports_its_figures(tmp_path: Path, gpu_check: ModuleType) -> None:
    out = tmp_path / "report.json"
    done = run_check(out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == gpu_check.PHASE_NAMES
    assert {name: p["status"] for name, p in phases.items()} == dict.fromkeys(gpu_check.PHASE_NAMES, "passed")
    assert report["device"] == "cpu" and report["summary"]["all_passed"] is True
    assert {"python", "torch", "transformers", "megatron_core", "device_name"} <= set(report["environment"])
    assert report["model"]["parameters"] > 0 and report["model"]["tied_embeddings"] is True
    for line in done.stdout.splitlines()[-len(phases) - 2 : -2]:
        assert line.split()[1] == "passed", line  # the table: phase, status, seconds, figures

    def figures(phase: str) -> dict:
        return phases[phase]["figures"]

    def checks(phase: str) -> set[str]:
        assert all(c["ok"] for c in phases[phase]["checks"])
        return {c["name"] for c in phases[phase]["checks"]}

    plan = figures("plan")
    assert plan["training_actor_bytes"] > 0 and plan["host_offload_bytes"] > 0
    assert figures("actor_vs_hf_fp32")["max_abs_diff"] <= 1e-4
    train = figures("train")
    assert train["tokens_per_step"] == 4 * 48 and train["tokens_per_s"] > 0 and len(train["step_times_s"]) == 2
    assert train["mfu"] is None  # no device peak on the CPU
    offload = figures("offload")
    for kind in ("weights", "grads", "optimizer"):  # Megatron pads its buffers a little
        assert offload[f"offloaded_{kind}_bytes"] == pytest.approx(plan[f"actor_{kind}_bytes"], rel=0.01)
    assert offload["host_arena_bytes"] == plan["host_offload_bytes"]
    assert {"actor_weights_as_planned", "actor_optimizer_as_planned", "host_arena_as_planned"} <= checks("offload")
    sync = figures("weight_sync")
    assert sync["transport"] == "shared-memory files" and sync["unequal"] == [] and sync["weight_version"] == "1"
    assert sync["tensors"] == 2 * 11 + 2 and sync["matrices_unchanged_by_training"] == []  # tied: no lm_head
    assert {"greedy_repeatable", "seed_repeats", "penalised_full_length", "prompt_top_logprobs"} <= checks(
        "engine_requests"
    )
    assert figures("logprob_mismatch")["max_abs"] < 1e-4  # fp32 on both sides
    assert figures("throughput")["output_tokens"] == 4 * 8 and figures("throughput")["tokens_per_s"] > 0
    assert "same_greedy_output_after_resume" in checks("release_resume")
    tests = figures("tests_gpu")
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # collected, and skipped without CUDA
    for suffix in (".log", ".engine.log", ".pytest.log"):
        assert out.with_suffix(suffix).is_file()
    section = subprocess.run(
        [sys.executable, str(SCRIPT), "--markdown", str(out)], capture_output=True, text=True, check=True
    ).stdout  # what docs/gpu.md's "Reports" gets
    rows = [line for line in section.splitlines() if line.startswith("| ") and "passed" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == gpu_check.PHASE_NAMES
    assert "- train: dtype float32" in section and "13 of 13 phases passed" in section


def test_a_check_out_of_time_skips_every_phase_naming_why(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = run_check(out, "--budget-s", "0", timeout_s=180)
    assert done.returncode == 1
    phases = json.loads(out.read_text())["phases"]
    assert {p["status"] for p in phases.values()} == {"skipped"}
    assert {p["reason"] for p in phases.values()} == {"skipped: out of time"}
    assert "0 of 13 phases passed" in done.stdout


def test_the_phase_running_when_the_time_is_up_is_stopped_and_the_rest_skipped(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = run_check(out, "--budget-s", "8", "--no-tests", timeout_s=180)
    assert done.returncode == 1
    report = json.loads(out.read_text())
    statuses = "".join(p["status"][0] for p in list(report["phases"].values())[:-1])  # p(assed), t(imeout), s(kipped)
    assert re.fullmatch(r"p*t?s+", statuses), statuses
    skipped = [p["reason"] for p in report["phases"].values() if p["status"] == "skipped"]
    assert set(skipped[:-1]) == {"skipped: out of time"} and skipped[-1] == "skipped: --no-tests"
    assert report["wall_s"] < 60  # the smoke process was stopped, not waited for


def test_a_raising_phase_is_recorded_and_what_needs_it_is_skipped(tmp_path: Path, gpu_check: ModuleType) -> None:
    smoke = gpu_check.Smoke("cpu", gpu_check.SIZES["cpu"], tmp_path, tmp_path / "engine.log")

    def broken(smoke: object, r: object) -> None:
        raise ValueError("no model today")

    record = gpu_check.run_phase(smoke, gpu_check.Phase("model", (), broken), 30)
    assert record.status == "error" and record.error["type"] == "ValueError"
    assert record.error["message"] == "no model today" and "no model today" in record.error["traceback"][-1]
    skipped = gpu_check.run_phase(smoke, gpu_check.SMOKE[2], 30)  # the plan needs the model
    assert (skipped.status, skipped.reason) == ("skipped", "needs what model did not make")

    def unsure(smoke: object, r: object) -> None:
        r.check("holds", True)
        r.check("fails", False, "by design")

    failed = gpu_check.run_phase(smoke, gpu_check.Phase("model", (), unsure), 30)
    assert failed.status == "failed"
    assert "failed check fails: by design" in gpu_check.format_table([failed])
