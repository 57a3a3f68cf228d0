"""`python -m userrl_megatron.fleet.watchdog PARENT_PID -- COMMAND...`: run a server command that has no
parent watch of its own (SGLang, sglang-router) and stop it when the process that launched it is gone.

Without it, a trainer (or Ray actor) that dies leaves a real SGLang server running and holding its port; the next
run's health check may then even be answered by that stale server. The launcher starts this watchdog as the
leader of a new process group; the server and everything it forks stay in that group, which the watchdog
signals (SIGTERM, then SIGKILL) once PARENT_PID no longer exists. `ServerProcess.stop()` signals the same group.
"""

import os
import signal
import subprocess
import sys
import time

POLL_S = 1.0
GRACE_S = 20.0


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m userrl_megatron.fleet.watchdog PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    server = subprocess.Popen(command)  # inherits this process group
    stopping = False

    def stop(*_: object) -> None:  # SIGTERM to the group (ServerProcess.stop): wait for the server's shutdown
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while server.poll() is None and not stopping:
        if not parent_alive(parent):
            server.send_signal(signal.SIGTERM)
            stopping = True
            break
        time.sleep(POLL_S)
    try:
        code = server.wait(GRACE_S if stopping else None)
    except subprocess.TimeoutExpired:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGKILL)  # the server and whatever it forked; this watchdog too
        code = -signal.SIGKILL
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
