"""One run per run directory: `userrl train` holds an exclusive lock on `<run_dir>/.lock` while it runs.

The lock is an `flock` on an open file, so the kernel drops it when the holder dies however it dies: a lock
file left by a killed run is simply taken over. The file names the holder (pid, host) for the refusal message.
On network filesystems without working `flock` the lock protects only runs on the same host.
"""

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO

from userrl_megatron.errors import UserError

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"


class RunLock:
    """`with RunLock(run_dir):` holds the run directory; a second holder gets a UserError naming the first."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._file: IO[str] | None = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(
                f"run directory {self.path.parent} is in use by {holder}: wait for it to end, stop it, "
                "or choose another run.name"
            ) from None
        f.seek(0)
        previous = f.read().strip()
        if previous:
            log.info("taking over the run directory lock of %s, which no longer runs", previous)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()  # an empty file: nobody holds it
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
