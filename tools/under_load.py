"""Run a command while other processes keep every core busy, then stop them: `make test-under-load` uses it to
show that no test depends on how fast the machine is.

    python tools/under_load.py [--workers N] -- COMMAND [ARG ...]

The workers spin at the command's own priority (a loaded laptop or a shared CI runner does not politely yield),
so the command gets about 1 / (1 + N / cores) of the CPU it would have on an idle machine. The exit status is the
command's.
"""

import argparse
import multiprocessing
import signal
import subprocess
import sys
import time

from userrl_megatron.cores import core_count


def spin() -> None:
    """Keep one core busy until terminated."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the command; the parent then stops us
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers", type=int, default=core_count(), help="busy processes (default: one for each core this may use)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    workers = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.workers)]
    for worker in workers:
        worker.start()
    print(f"under_load: {len(workers)} busy processes on {core_count()} cores while running: {' '.join(command)}")
    start = time.monotonic()
    try:
        code = subprocess.call(command)
    except KeyboardInterrupt:
        code = 130
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join()
    minutes, seconds = divmod(int(time.monotonic() - start), 60)
    print(f"under_load: exit {code} after {minutes} min {seconds} s with {len(workers)} busy processes")
    return code


if __name__ == "__main__":
    sys.exit(main())
