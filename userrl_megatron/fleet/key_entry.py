"""Run a Python module that takes its API key only as a command-line flag (SGLang's and sglang-router's
`--api-key`) with the key read from an environment variable instead, so that it never shows in the process table
(`ps`, `/proc/<pid>/cmdline`, readable by every local user) and never reaches the log.

    python key_entry.py ENV_NAME MODULE [ARGS...]

runs `python -m MODULE ARGS... --api-key=<$ENV_NAME>` in this process: the flag is added to `sys.argv` after
start-up, the variable is removed from the environment (the module's own subprocesses do not inherit it), and
this process's stdout and stderr (which its subprocesses inherit) pass through a filter that writes the key as
`<redacted>` (SGLang logs its resolved arguments, the key among them, at start-up).

It runs under SGLang's interpreter (`.venv-sglang`), so it imports the standard library only, and it is run by
path: its directory (`userrl_megatron/rollout`, which holds a `sglang.py`) is taken off `sys.path` first.
"""

import atexit
import os
import runpy
import sys
import threading

REDACTED = b"<redacted>"


def _pump(source: int, sink: int, secret: bytes) -> None:
    """Copy `source` to `sink` line by line with `secret` replaced (a line is never split around it)."""
    pending = b""
    while chunk := os.read(source, 65536):
        pending += chunk
        lines, newline, pending = pending.rpartition(b"\n")
        if newline:
            os.write(sink, (lines + newline).replace(secret, REDACTED))
        if len(pending) > 65536:  # a very long line: write what cannot hold the start of the secret
            keep = len(secret) - 1
            os.write(sink, pending[:-keep].replace(secret, REDACTED))
            pending = pending[-keep:]
    if pending:
        os.write(sink, pending.replace(secret, REDACTED))


def redact_output(secret: bytes) -> None:
    """Route fds 1 and 2 through one pipe whose reader writes to the original stdout with `secret` redacted."""
    read_end, write_end = os.pipe()
    original = os.dup(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, original, secret), daemon=True, name="redact")
    pump.start()

    def drain() -> None:  # at exit: let the filter write what is in the pipe (subprocesses may hold it open)
        sys.stdout.flush()
        sys.stderr.flush()
        pump.join(timeout=1.0)

    atexit.register(drain)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: key_entry.py ENV_NAME MODULE [ARGS...]")
    name, module, args = argv[0], argv[1], argv[2:]
    key = os.environ.pop(name, "")
    if not key:
        sys.exit(f"key_entry: the environment variable {name} holding the API key is unset or empty")
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    redact_output(key.encode())
    sys.argv = [module, *args, f"--api-key={key}"]  # one token: a key may start with "-"
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
