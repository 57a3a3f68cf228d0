"""`make gpu-check`: the most evidence one GPU gives in about 8 minutes (docs/gpu.md has the device procedure).

    python tools/gpu_check.py --out runs/gpu_check/report.json             # one CUDA GPU
    python tools/gpu_check.py --device cpu --out runs/gpu_check/cpu.json   # the same phases, tiny, on CPU (CI)

A smoke sequence on a random Qwen3 built from a config (about 0.3B parameters on CUDA, no downloads), run by the
project's own modules in one process of its own (world size 1: NCCL on CUDA, gloo on CPU, no Ray):

  environment       versions and the device
  model             the random Qwen3, saved as an HF directory (fp32 safetensors)
  plan              `userrl plan`'s prediction (`plan.plan_run`) for the layout the phases below use
  actor_vs_hf_fp32  the Megatron actor's log-probs in fp32 against transformers' on the same device
  train             two training steps (bf16 on CUDA): tokens/s, MFU, measured peak memory beside the plan's
  offload           what `offload` frees per kind beside the plan; log-probs bit-equal after `onload`
  engine_start      an embedded engine server on the same device
  weight_sync       the colocated sync (CUDA-IPC handles on CUDA, shared-memory files on CPU) of the trained
                    weights; every tensor read back from the engine equal
  engine_requests   greedy, seeded sampled, penalised and prompt-log-prob requests
  logprob_mismatch  the engine's log-probs of sampled tokens against the actor's
  throughput        output tokens/s at 32 concurrent requests (and at one)
  release_resume    the trainer's hand-off: the engine releases everything (device memory freed), its weights come
                    back empty (generation refused) until the actor's are pushed (same output)
  simulator_schema  an engine started as the run starts its user simulator's, on a random Qwen3 with the real
                    tokenizer: one request per reply schema the gyms state; every reply valid JSON of its schema
  train_largest     the engine stopped, the largest random Qwen3 (1.7B, 4B or 8B shapes) whose training the plan
                    fits in the free device memory: tokens/s and MFU of its training steps, its peak beside the plan

then `tests/gpu` (pytest, in a process of its own). Each phase has a time budget; a phase that raises is recorded
(type, message, the last traceback lines) and the next one runs (phases that need what it would have made are
skipped, naming it); a phase over its budget stops the smoke process, and what did not run is listed as skipped.
The whole check stops starting phases at --budget-s. It prints a table and writes JSON (--out), the smoke
process's log beside it (.log), the engine's (.engine.log) and pytest's (.pytest.log). Exit status 0 when every
phase passed.
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tools"):  # the project, tests/support and gpu_phases, however this file was loaded
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from gpu_phases import PHASE_NAMES, SMOKE, run_phase, smoke_child  # noqa: E402 (after the path)
from gpu_smoke import GIB, SIZES, Phase, Record, Smoke  # noqa: E402

__all__ = ["PHASE_NAMES", "SIZES", "SMOKE", "Phase", "Record", "Smoke", "main", "run_phase"]
SCHEMA_VERSION = 1
# ---------------------------------------------------------------------------------------------------------------
# The driver: budgets, the smoke process, tests/gpu, the table and the JSON
# ---------------------------------------------------------------------------------------------------------------


class Clock:
    """The whole check's deadline."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def run_smoke(device: str, work: Path, paths: dict[str, Path], clock: Clock, report: Callable[[Record], None]) -> None:
    """Run the smoke process, enforcing each phase's budget and the deadline; `report` gets each record."""
    sizes = SIZES[device]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU check on a GPU machine stays on the CPU
    args = (out, device, str(work), str(paths["log"]), str(paths["engine_log"]))
    child = ctx.Process(target=smoke_child, args=args, daemon=False)
    child.start()
    if device == "cpu":
        _restore_env("CUDA_VISIBLE_DEVICES", env_before)
    done: set[str] = set()
    current: str | None = None
    started = time.monotonic()  # of the current phase, or of the last message between phases
    stopped = ""
    while True:
        try:
            kind, name, payload = out.get(timeout=1.0)
        except queue.Empty:
            if current is None and time.monotonic() - started > sizes.between_phases_s:
                stopped = f"the smoke process said nothing for {sizes.between_phases_s:.0f} s between phases"
            elif current is not None and time.monotonic() - started > sizes.budget_s[current]:
                stopped = f"{current} ran past its {sizes.budget_s[current]:.0f} s budget"
            elif current is not None and clock.left() <= 0:
                stopped = f"the check's {clock.total_s:.0f} s ran out during {current}"
            elif not child.is_alive():
                stopped = f"the smoke process died (exit code {child.exitcode})"
            else:
                continue
            _kill(child)
            if current is not None:
                r = Record(current, budget_s=sizes.budget_s[current], seconds=time.monotonic() - started)
                r.status = "timeout" if "budget" in stopped or "ran out" in stopped else "error"
                r.reason = stopped
                report(r)
                done.add(current)
            break
        if kind == "start":
            if clock.left() <= 0:  # no phase starts after the deadline
                stopped = "skipped: out of time"
                _kill(child)
                break
            current, started = name, time.monotonic()
        elif kind == "done":
            report(Record(**payload))
            done.add(name)
            current, started = None, time.monotonic()
        else:
            break
    child.join(timeout=60)
    if child.is_alive():
        _kill(child)
    for phase in SMOKE:
        if phase.name not in done:
            why = "out of time" if "out of time" in stopped or "ran out" in stopped else stopped or "not reported"
            report(Record(phase.name, budget_s=sizes.budget_s[phase.name], reason=f"skipped: {why}"))


def run_tests_gpu(device: str, paths: dict[str, Path], clock: Clock) -> Record:
    """`pytest tests/gpu` in a process of its own, within its budget and what is left of the check's."""
    budget = min(SIZES[device].budget_s["tests_gpu"], clock.left())
    r = Record("tests_gpu", budget_s=budget)
    if budget < 20:
        r.reason = "skipped: out of time"
        return r
    junit = paths["log"].with_suffix(".junit.xml")
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    env = {**os.environ}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    with open(paths["pytest_log"], "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, process_group=0)
        try:
            code = process.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    r.seconds = time.perf_counter() - start
    counts = _junit_counts(junit)
    with contextlib.suppress(OSError):
        junit.unlink()
    r.figure(exit_code=code, **counts)
    if code is None:
        r.status, r.reason = "timeout", f"pytest ran past {budget:.0f} s ({paths['pytest_log'].name} has its output)"
        return r
    r.check(
        "no_failures",
        counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0,
        ", ".join(counts.get("failures", [])),
    )
    r.check("pytest_exit_status", code in (0, 5) if counts.get("tests", 0) == 0 else code == 0, f"exit code {code}")
    r.status = "passed" if all(c["ok"] for c in r.checks) else "failed"
    r.summary = (
        f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
        f"{counts.get('skipped', 0)} skipped"
    )
    return r


def _junit_counts(path: Path) -> dict[str, Any]:
    """Counts and failing test ids from pytest's JUnit XML (empty if pytest wrote none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            failing.append(f"{case.get('classname')}::{case.get('name')}: {message}")
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failures": failing,
    }


def _kill(child: Any) -> None:
    with contextlib.suppress(ProcessLookupError, AttributeError):
        os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=10)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def format_table(records: list[Record]) -> str:
    """The table the check prints: one row per phase, then what failed."""
    lines = [f"{'phase':<18} {'status':<8} {'s':>6}  figures", "-" * 100]
    for r in records:
        text = r.summary or r.reason
        if r.error:
            text = f"{r.error['type']}: {r.error['message'].splitlines()[0] if r.error['message'] else ''}"[:160]
        lines.append(f"{r.name:<18} {r.status:<8} {r.seconds:>6.1f}  {text}")
        for c in r.checks:
            if not c["ok"]:
                lines.append(f"{'':<35}failed check {c['name']}: {c['detail']}")
    return "\n".join(lines)


def build_report(device: str, records: list[Record], wall_s: float, budget_s: float) -> dict[str, Any]:
    """The JSON document: environment, model, each phase, and a summary by status."""
    by_name = {r.name: r for r in records}
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    env = by_name.get("environment")
    model = by_name.get("model")
    return {
        "schema": SCHEMA_VERSION,
        "tool": "tools/gpu_check.py",
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall_s,
        "budget_s": budget_s,
        "environment": env.figures if env else {},
        "model": model.figures if model else {},
        "phases": {r.name: r.as_dict() for r in records},
        "summary": {"statuses": statuses, "all_passed": all(r.status == "passed" for r in records)},
    }


def render_markdown(document: dict[str, Any]) -> str:
    """A report's section for docs/gpu.md ("Reports"): device, date, versions, the table, then every figure."""
    env, phases = document["environment"], document["phases"]
    passed = sum(p["status"] == "passed" for p in phases.values())
    lines = [  # the JSON keeps the commit; docs name no commits
        f"### {document['date'][:10]}, {env.get('device_name', document['device'])}",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, megatron-core "
        f"{env.get('megatron_core')}, Python {env.get('python')}, driver {env.get('driver', '-')}; {passed} of "
        f"{len(phases)} phases passed in {document['wall_s']:.0f} s (budget {document['budget_s']:.0f} s).",
        "",
        "| phase | status | s | result |",
        "|---|---|---|---|",
    ]
    for name, p in phases.items():
        text = p["summary"] or p["reason"]
        if p["error"]:
            text = f"{p['error']['type']}: {p['error']['message'].splitlines()[0] if p['error']['message'] else ''}"
        failed = [f"failed check {c['name']}: {c['detail']}" for c in p["checks"] if not c["ok"]]
        cell = "; ".join([text[:300], *failed]).replace("|", "\\|")
        lines.append(f"| {name} | {p['status']} | {p['seconds']:.1f} | {cell} |")
    lines += ["", "Figures (bytes as GiB):", ""]
    for name, p in phases.items():
        if p["figures"] and name != "environment":
            shown = ", ".join(f"{k} {_figure(k, v)}" for k, v in p["figures"].items() if k not in ("layout", "url"))
            lines.append(f"- {name}: {shown}")
    return "\n".join(lines) + "\n"


def _figure(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int | float) and key.endswith("_bytes"):
        return f"{value / GIB:.3f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return "[" + ", ".join(_figure(key, v) for v in value[:8]) + (", ...]" if len(value) > 8 else "]")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_figure(key, v)}" for k, v in value.items()) + "}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: one GPU; cpu: the tiny CI run")
    p.add_argument("--out", default="runs/gpu_check/report.json", help="the JSON report (logs beside it)")
    p.add_argument("--budget-s", type=float, default=None, help="no phase starts after this (default 480 on cuda)")
    p.add_argument("--no-tests", action="store_true", help="skip tests/gpu")
    p.add_argument("--markdown", metavar="REPORT", help="print a report's section for docs/gpu.md and exit")
    args = p.parse_args(argv)
    if args.markdown:
        print(render_markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --device cpu runs the same phases on the CPU", file=sys.stderr)
        return 2
    sizes = SIZES[args.device]
    total_s = sizes.total_budget_s if args.budget_s is None else args.budget_s
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    paths = {
        "log": Path(f"{stem}.log"),
        "engine_log": Path(f"{stem}.engine.log"),
        "pytest_log": Path(f"{stem}.pytest.log"),
    }
    for path in paths.values():
        path.unlink(missing_ok=True)
    clock = Clock(total_s)
    records: list[Record] = []

    def report(r: Record) -> None:
        records.append(r)
        text = r.summary or r.reason or (r.error or {}).get("type", "")
        print(f"gpu_check: {r.name:<18} {r.status:<8} {r.seconds:6.1f} s  {text}", flush=True)

    # Every process the check starts (the smoke process, the engine server, pytest) imports the checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        run_smoke(args.device, work, paths, clock, report)
        if args.no_tests:
            report(Record("tests_gpu", budget_s=sizes.budget_s["tests_gpu"], reason="skipped: --no-tests"))
        else:
            report(run_tests_gpu(args.device, paths, clock))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - clock.start
    document = build_report(args.device, records, wall, total_s)
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print()
    print(format_table(records))
    print(f"\n{sum(r.status == 'passed' for r in records)} of {len(records)} phases passed in {wall:.0f} s; {out}")
    return 0 if document["summary"]["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
