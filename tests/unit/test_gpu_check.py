"""tools/gpu_check.py (`make gpu-check`) on the CPU: every phase of the GPU check passes at its CPU size and writes
the figures docs/gpu.md reports, so the script cannot rot between GPU runs; a raising phase is recorded and the
next one runs; a check out of time skips what is left, naming why."""

import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.tools import load_tool

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.py"
HANG_S = 7200.0  # the CPU check's own bounds (600 s a phase, 3600 s in all) stop a hang before this


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return load_tool("gpu_check")


def run_check(out: Path, *args: str, timeout_s: float = HANG_S) -> subprocess.CompletedProcess:
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
    assert {"refused_before_the_push", "same_greedy_output_after_the_push"} <= checks("release_resume")
    simulator = figures("simulator_schema")  # the CPU size asks with the first two schemas only
    assert simulator["schemas"] == simulator["valid"] == 2 and simulator["completion_tokens_max"] < 512
    assert {"engine_alive", "every_reply_valid"} <= checks("simulator_schema")
    largest = figures("train_largest")  # no device memory to fit on the CPU: the largest candidate
    assert largest["model"] == "tiny-4-layers" and list(largest["planned_actor_bytes"]) == ["tiny", "tiny-4-layers"]
    assert largest["planned_actor_bytes"]["tiny"] < largest["planned_actor_bytes"]["tiny-4-layers"]
    assert largest["tokens_per_step"] == 4 * 48 and len(largest["step_times_s"]) == 3 and largest["mfu"] is None
    assert {"a_candidate_fits", "finite_losses"} <= checks("train_largest")
    tests = figures("tests_gpu")
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # collected, and skipped without CUDA
    for suffix in (".log", ".engine.log", ".pytest.log"):
        assert out.with_suffix(suffix).is_file()
    section = subprocess.run(
        [sys.executable, str(SCRIPT), "--markdown", str(out)], capture_output=True, text=True, check=True
    ).stdout  # what docs/gpu.md's "Reports" gets
    rows = [line for line in section.splitlines() if line.startswith("| ") and "passed" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == gpu_check.PHASE_NAMES
    assert "- train: dtype float32" in section and "15 of 15 phases passed" in section


@pytest.mark.parametrize("no_tests", [False, True])
def test_a_check_out_of_time_skips_every_phase_naming_why(tmp_path: Path, no_tests: bool) -> None:
    out = tmp_path / "report.json"
    done = run_check(out, "--budget-s", "0", *(["--no-tests"] if no_tests else []))
    assert done.returncode == 1
    phases = json.loads(out.read_text())["phases"]
    assert {p["status"] for p in phases.values()} == {"skipped"}
    reasons = [p["reason"] for p in phases.values()]
    assert set(reasons[:-1]) == {"skipped: out of time"}
    assert reasons[-1] == ("skipped: --no-tests" if no_tests else "skipped: out of time")  # tests_gpu
    assert "0 of 15 phases passed" in done.stdout


def test_the_phase_running_when_the_time_is_up_is_stopped_and_the_rest_skipped(
    tmp_path: Path, gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver against a smoke process whose second phase runs for 600 s, on a clock whose time is up while
    that phase runs: it is stopped, not waited for, whatever the speed of the machine."""
    from tests.support import stalled_smoke

    assert tuple(gpu_check.PHASE_NAMES[:2]) == stalled_smoke.PHASES
    monkeypatch.setattr(gpu_check, "smoke_child", stalled_smoke.stalled_smoke_child)
    records: list = []

    class Clock:
        """gpu_check.Clock as the driver reads it: when a phase starts (none starts once the time is up) and, while
        one runs, after each second without a message. Once the first phase is reported, the next reading is the
        second phase's start, which finds time left; every later one finds the time up, while that phase runs."""

        total_s, start, readings = 8.0, time.monotonic(), 0

        def left(self) -> float:
            if not records:
                return self.total_s
            self.readings += 1
            return self.total_s if self.readings == 1 else 0.0

    paths = {"log": tmp_path / "smoke.log", "engine_log": tmp_path / "engine.log"}
    gpu_check.run_smoke("cpu", tmp_path, paths, Clock(), records.append)
    assert [r.name for r in records] == gpu_check.PHASE_NAMES[:-1]  # every smoke phase once, in order
    assert [(r.status, r.reason) for r in records[:2]] == [
        ("passed", ""),
        ("timeout", "the check's 8 s ran out during model"),
    ]
    assert {(r.status, r.reason) for r in records[2:]} == {("skipped", "skipped: out of time")}
    smoke = int((tmp_path / "smoke.pid").read_text())
    assert not Path(f"/proc/{smoke}").exists()  # killed (and reaped) at once: a wait would have taken 600 s


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


def test_the_training_peak_is_broken_down_by_the_sites_live_at_it(gpu_check: ModuleType) -> None:
    def frame(path: str, line: int, name: str) -> dict[str, object]:
        return {"filename": path, "line": line, "name": name}

    logits = [frame("/x/torch/nn/functional.py", 1, "linear"), frame("/r/userrl_megatron/megatron/logits.py", 9, "f")]
    layer = [frame("/site/megatron/core/transformer/mlp.py", 120, "forward")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": layer},
        {"action": "alloc", "addr": 2, "size": 300, "frames": logits},
        {"action": "alloc", "addr": 3, "size": 50, "frames": [frame("/lib/other.py", 3, "g")]},
        {"action": "free_requested", "addr": 2, "size": 300, "frames": logits},  # still counted: not yet freed
        {"action": "alloc", "addr": 4, "size": 25, "frames": layer},  # the peak: 475
        {"action": "free_completed", "addr": 2, "size": 300, "frames": logits},
        {"action": "alloc", "addr": 5, "size": 200, "frames": logits},  # 375: below the peak
    ]
    peak, sites = sys.modules["gpu_smoke"].live_at_peak(trace)  # loaded by gpu_check
    assert peak == 475
    assert sites == [
        (300, "userrl_megatron/megatron/logits.py:9 f"),
        (125, "megatron/core/transformer/mlp.py:120 forward"),
        (50, "elsewhere"),
    ]


def test_train_largest_takes_the_largest_candidate_its_plan_fits(gpu_check: ModuleType) -> None:
    phases = load_tool("gpu_phases")  # importable once gpu_check has put tools/ on the path
    largest_fitting, share = phases.largest_fitting, phases.LARGEST_SHARE_OF_FREE
    planned = {"1.7b": 54, "4b": 113, "8b": 193}
    assert largest_fitting(planned, 137) == "4b"  # 113 <= 0.9 x 137
    assert largest_fitting(planned, 78) == "1.7b"
    assert largest_fitting(planned, int(113 / share) - 1) == "1.7b"
    assert largest_fitting(planned, 50) is None
    assert largest_fitting(planned, None) == "8b"  # nothing to fit: the CPU
