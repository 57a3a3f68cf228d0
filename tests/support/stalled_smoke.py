"""A stand-in for the smoke process of `tools/gpu_check.py` (tests/unit/test_gpu_check.py): its first phase passes
at once and its second runs until HANG_S, then reports that it passed. A check whose time is up while the second
phase runs must stop it there: one that waited for it would take HANG_S and record the phase as passed."""

import os
import time
from pathlib import Path
from typing import Any

HANG_S = 600.0
PHASES = ("environment", "model")  # the first two of gpu_phases.PHASE_NAMES (the test checks they still are)


def stalled_smoke_child(out: Any, device: str, work: str, log_path: str, engine_log: str) -> None:
    """`gpu_phases.smoke_child`'s signature and messages; its pid is written to WORK/smoke.pid."""
    from gpu_smoke import Record  # tools/ is on the path of the process that spawned this one (gpu_check puts it)

    Path(work, "smoke.pid").write_text(str(os.getpid()))
    first, second = PHASES
    out.put(("start", first, None))
    out.put(("done", first, Record(first, status="passed").as_dict()))
    out.put(("start", second, None))
    time.sleep(HANG_S)
    out.put(("done", second, Record(second, status="passed").as_dict()))
    out.put(("end", None, None))
