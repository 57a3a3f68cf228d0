"""The run-directory lock: a second holder is refused with the first's pid; a dead holder's lock is taken over."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from userrl_megatron.actors.run_lock import RunLock
from userrl_megatron.errors import UserError

HOLD = """
import sys, time
from pathlib import Path
from userrl_megatron.actors.run_lock import RunLock
with RunLock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()  # hold until the test closes our stdin (or kills us)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(UserError, match=rf"in use by pid {holder.pid} on "):
            RunLock(tmp_path).__enter__()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with RunLock(tmp_path) as lock:  # released at the holder's exit
        assert lock.path.read_text() == f"pid {os.getpid()} on {os.uname().nodename}\n"
    assert lock.path.read_text() == ""


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = _holder(tmp_path)
    holder.kill()
    holder.wait(timeout=60)
    assert f"pid {holder.pid}" in (tmp_path / ".lock").read_text()  # the file stays behind
    with caplog.at_level("INFO"), RunLock(tmp_path):
        pass
    assert f"taking over the run directory lock of pid {holder.pid}" in caplog.text
