"""tools/under_load.py: the command's exit status and output pass through, and the busy workers stop with it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tools" / "under_load.py")


def test_the_command_runs_beside_busy_workers_and_its_status_is_returned(tmp_path: Path) -> None:
    pids = tmp_path / "children"
    # The command lists its siblings (the workers, children of the same parent) before exiting with 3.
    code = (
        "import os, sys, pathlib\n"
        "parent = os.getppid()\n"
        "kids = [p for p in os.listdir('/proc') if p.isdigit() and p != str(os.getpid())\n"
        "        and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == str(parent)]\n"
        f"pathlib.Path({str(pids)!r}).write_text(' '.join(kids))\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, SCRIPT, "--workers", "2", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines()[0].startswith("under_load: 2 busy processes on ")
    assert "under_load: exit 3 after " in done.stdout.splitlines()[-1]
    workers = pids.read_text().split()
    assert len(workers) == 2
    assert not [p for p in workers if Path(f"/proc/{p}").exists()]  # stopped and reaped


def test_a_missing_command_is_refused() -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--workers", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert "give the command to run after --" in done.stderr
