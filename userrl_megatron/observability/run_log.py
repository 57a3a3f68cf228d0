"""`run.log` in the run directory: everything the console showed (log lines, the per-step lines, the table,
what Ray forwards from the workers), appended run after run, without terminal colour codes.

`with run_log(path):` tees this process's stdout and stderr into the file (created 0600: readable by the run's
owner only) and points the logging handlers that wrote to the console at the tees; on exit everything is put
back.
"""

import contextlib
import datetime
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Tee:
    """A text stream that writes to the console stream and, without colour codes, to the log file."""

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(_ANSI.sub("", text))
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the console's
        return getattr(self.console, name)


@contextlib.contextmanager
def run_log(path: str | Path) -> Iterator[Path]:
    """Tee stdout and stderr into `path` (appending) for the duration of the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    original = {"stdout": sys.stdout, "stderr": sys.stderr}
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)  # its owner's only
    with contextlib.suppress(OSError):  # an existing file of another owner stays as it was
        os.fchmod(fd, 0o600)
    with os.fdopen(fd, "a", buffering=1, encoding="utf-8") as log:
        started = datetime.datetime.now().isoformat(timespec="seconds")
        log.write(f"==== {started} pid {os.getpid()}: {' '.join(sys.argv)}\n")
        tees = {name: _Tee(stream, log) for name, stream in original.items()}
        redirected = _redirect_handlers({id(s): tees[n] for n, s in original.items()})
        sys.stdout, sys.stderr = tees["stdout"], tees["stderr"]
        try:
            yield path
        except BaseException as e:  # the CLI prints it after the block: record what it will show
            log.write(_ending(e))
            raise
        finally:
            sys.stdout, sys.stderr = original["stdout"], original["stderr"]
            for handler, stream in redirected:
                handler.setStream(stream)


def _ending(error: BaseException) -> str:
    """What the console will show for `error`: the CLI's `userrl: error:` lines, or a traceback."""
    from userrl_megatron.config.loader import ConfigError
    from userrl_megatron.errors import UserError

    if isinstance(error, ConfigError):
        return "".join(f"userrl: error: {p}\n" for p in error.problems)
    if isinstance(error, UserError):
        return f"userrl: error: {error}\n"
    return "".join(traceback.format_exception(error))


def _redirect_handlers(tee_of: dict[int, _Tee]) -> list[tuple[logging.StreamHandler, Any]]:
    """Point every console handler of the root logger at its tee; returns what to restore."""
    redirected = []
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and id(handler.stream) in tee_of:
            redirected.append((handler, handler.setStream(tee_of[id(handler.stream)])))
    return redirected
