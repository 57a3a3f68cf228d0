"""Blocking work off the event loop, in daemon threads that never hold up the server's exit.

`asyncio.to_thread` uses the loop's default executor, whose workers `asyncio.run` and the interpreter join on
exit: six group joins stuck in a rendezvous kept `userrl serve` alive long after SIGTERM. Daemon threads are not
joined; a call still running when the server stops is left behind with the process.
"""

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class DaemonPool:
    """`size` daemon threads running blocking calls (tokenising) for the event loop, first come first served."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # the caller gets it
                future.set_exception(e)

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on a pool thread; the event loop goes on meanwhile."""
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return await asyncio.wrap_future(future)


def start_daemon(fn: Callable[[], T], name: str) -> Future[T]:
    """Run `fn()` in a daemon thread of its own; the future holds its result or exception."""
    future: Future[T] = Future()

    def target() -> None:
        future.set_running_or_notify_cancel()  # a running future cannot be cancelled: its outcome is always set
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


async def wait_bounded(future: Future[T], timeout_s: float, what: str) -> T:
    """The result of a thread's `future`, waiting at most `timeout_s`; past it, TimeoutError naming `what` and the
    config field (the thread runs on by itself: its own timeout, where it has one, ends it)."""
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"{what} did not finish within {timeout_s:g} s (rollout.embedded.control_timeout_s)"
        ) from None
