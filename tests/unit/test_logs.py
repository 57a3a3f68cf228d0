"""Logs a person reads: third-party noise filtered, step N/total with elapsed and ETA, heartbeats during long
phases, run.log with what the console showed, infrastructure failures in the step table."""

import asyncio
import importlib.util
import io
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from userrl_megatron.errors import UserError
from userrl_megatron.observability.progress import StepProgress, blocking_heartbeat, format_duration, heartbeat
from userrl_megatron.observability.run_log import run_log
from userrl_megatron.trainer.report import print_report

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed: no such warnings")
def test_megatron_import_warnings_are_filtered_on_cpu() -> None:
    imports = "from userrl_megatron.megatron.cpu import stub_missing_kernels\nstub_missing_kernels()\n"
    imports += "import userrl_megatron.megatron.optimizer, userrl_megatron.megatron.model\n"
    noisy = run_python(imports)
    assert "Transformer Engine and Apex are not installed" in noisy.stderr  # what workers printed before
    quiet = run_python(
        "from userrl_megatron.observability.noise import quiet_third_party\nquiet_third_party()\n" + imports
    )
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_gpu_keeps_missing_accelerator_warnings_once_and_request_loggers_follow_the_level() -> None:
    code = (
        "import logging, warnings\n"
        "from userrl_megatron.observability.noise import quiet_third_party\n"
        "quiet_third_party(on_gpu=True)\n"
        "for _ in range(3):\n"
        "    warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
        "    warnings.warn('MimoModelConfig is experimental and still under active development')\n"
        "print(logging.getLogger('httpx').level, logging.getLogger('openai').level)\n"
        "quiet_third_party(level='DEBUG')\n"
        "print(logging.getLogger('aiohttp.access').level)\n"
    )
    result = run_python(code)
    assert result.stderr.count("Apex is not installed") == 1 and "Mimo" not in result.stderr
    assert result.stdout.split() == ["30", "30", "30"]  # WARNING; at DEBUG they are left as they were


def test_progress_line_counts_steps_of_this_process() -> None:
    now = [100.0]
    progress = StepProgress(total_steps=10, clock=lambda: now[0])
    now[0] = 130.0
    assert progress.line(4) == "step 4/10  elapsed 30s  ETA 3m00s"  # resumed at step 3: one step took 30 s
    now[0] = 190.0
    assert progress.line(5) == "step 5/10  elapsed 1m30s  ETA 3m45s"
    now[0] = 8000.0
    assert progress.line(10) == "step 10/10  elapsed 2h11m  done"
    assert format_duration(59.6) == "1m00s" and format_duration(-1) == "0s"


def test_heartbeat_reports_during_a_phase(caplog: pytest.LogCaptureFixture) -> None:
    async def phase() -> None:
        done = [0]
        async with heartbeat(lambda: f"rollout: {done[0]}/16 episodes done", interval_s=0.01):
            while not any("rollout: 3/16 episodes done" in r.message for r in caplog.records):
                done[0] = min(done[0] + 1, 3)
                await asyncio.sleep(0.005)

    with caplog.at_level(logging.INFO, logger="userrl_megatron.progress"):
        asyncio.run(asyncio.wait_for(phase(), timeout=60))
    beats = [r.getMessage() for r in caplog.records if r.name == "userrl_megatron.progress"]
    assert beats and all(m.startswith("rollout: ") and m.endswith("s") for m in beats)


def test_blocking_heartbeat_reports_while_waiting(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="userrl_megatron.progress"):
        with blocking_heartbeat(lambda: "actor: save still running", interval_s=0.01):
            deadline = time.monotonic() + 60  # a generous bound on waiting, not a timing assertion
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.005)
        count = len(caplog.records)
    assert caplog.records[0].getMessage().startswith("actor: save still running, ")
    assert len(caplog.records) == count  # the thread stopped with the block


def test_run_log_holds_what_the_console_showed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("test_run_log")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logging.getLogger().addHandler(handler)  # a console handler made before the tee, as basicConfig makes it
    logger.propagate = False
    try:
        with run_log(tmp_path / "run.log"):
            print("a plain line")
            Console(force_terminal=True).print("[bold]step 1[/bold]  rollout/reward_mean=0.5")
            logging.getLogger().handlers[-1].handle(logging.makeLogRecord({"msg": "a log line", "levelno": 20}))
        print("after the block")
    finally:
        logging.getLogger().removeHandler(handler)
    text = (tmp_path / "run.log").read_text()
    assert "a plain line\n" in text and "step 1  rollout/reward_mean=0.5\n" in text and "a log line\n" in text
    assert "\x1b[" not in text and "after the block" not in text
    shown = capsys.readouterr()
    assert "a plain line" in shown.out and "a log line" in shown.err and "\x1b[1m" in shown.out
    assert handler.stream is sys.stderr  # put back
    with pytest.raises(UserError), run_log(tmp_path / "run.log"):
        raise UserError("no engine is left")
    assert (tmp_path / "run.log").read_text().endswith("userrl: error: no engine is left\n")


def test_step_table_shows_infrastructure_failures(tmp_path: Path) -> None:
    rows = [
        {"step": 1, "rollout/episodes": 16.0, "rollout/reward_mean": 0.5, "user_sim/calls": 9.0},
        {"step": 2, "rollout/episodes": 16.0, "rollout/infra_failed": 3.0, "rollout/finish/engine_error": 0.1875},
        {"step": 3, "rollout/episodes": 16.0, "rollout/finish/user_sim_error": 0.5, "user_sim/calls": 4.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    print_report(tmp_path, Console(file=out, width=250, highlight=False))
    text = out.getvalue().splitlines()
    header = [c.strip() for c in next(line for line in text if "┃" in line).split("┃")[1:-1]]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text if "│" in line]
    infra, engine, sim = header.index("infra fail"), header.index("engine err"), header.index("sim err")
    assert [(r[infra], r[engine], r[sim]) for r in cells] == [
        ("-", "0%", "0%"),
        ("3", "19%", "-"),  # a run without a simulator has no simulator errors to show
        ("-", "0%", "50%"),
    ]


def test_run_log_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """run.log holds what the console showed (prompts, paths, errors): created 0600, and an existing one made
    0600 (issue 57: it was 0644)."""
    fresh, old = tmp_path / "a" / "run.log", tmp_path / "run.log"
    old.write_text("earlier run\n")
    old.chmod(0o644)
    for path in (fresh, old):
        with run_log(path):
            print("a line")
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.read_text().endswith("a line\n")
