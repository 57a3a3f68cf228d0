"""Where a run is: a progress line after each step (step N/total, elapsed, ETA) and a heartbeat during long
phases (e.g. `rollout: 12/16 episodes done, 40 s`), so that no minute passes without a line.

Lines go through `logging` (logger `userrl_megatron.progress`), hence to the console and `run.log`.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

log = logging.getLogger("userrl_megatron.progress")

HEARTBEAT_S = 30.0  # seconds between heartbeat lines of a running phase


def format_duration(seconds: float) -> str:
    """`45s`, `3m05s`, `2h07m`: short and fixed-order, for progress lines."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepProgress:
    """Counts the steps this process trains; `done(step)` logs `step N/total` with elapsed time and an ETA
    from the mean duration of the steps trained so far (resumed steps do not count)."""

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total_steps
        self.clock = clock
        self.started = clock()
        self.steps = 0

    def line(self, step: int) -> str:
        """The progress line after `step` finished (counts it)."""
        self.steps += 1
        elapsed = self.clock() - self.started
        left = max(self.total - step, 0)
        eta = "done" if left == 0 else f"ETA {format_duration(elapsed / self.steps * left)}"
        return f"step {step}/{self.total}  elapsed {format_duration(elapsed)}  {eta}"

    def done(self, step: int) -> None:
        """Log the progress line of `step`."""
        log.info(self.line(step))


@contextlib.asynccontextmanager
async def heartbeat(describe: Callable[[], str], interval_s: float = HEARTBEAT_S) -> AsyncIterator[None]:
    """While the block runs, log `describe()` and the time spent every `interval_s` seconds."""
    started = time.monotonic()

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            log.info("%s, %s", describe(), format_duration(time.monotonic() - started))

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.contextmanager
def blocking_heartbeat(describe: Callable[[], str], interval_s: float = HEARTBEAT_S) -> Iterator[None]:
    """`heartbeat` for a blocking call (e.g. waiting on Ray): a thread logs while the block runs."""
    started, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            log.info("%s, %s", describe(), format_duration(time.monotonic() - started))

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
