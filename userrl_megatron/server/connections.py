"""The server's open connections: a cap below the open-file limit, idle ones evicted first, logs rate-limited.

aiohttp holds a connection that never sends a request until its keep-alive timeout (the server passes
`idle_timeout_s`), and accepts connections until the process runs out of file descriptors; asyncio then logs a
traceback per refused accept. Here the connections are counted as aiohttp's `Server` sees them: past the cap a new
connection closes the oldest one that is not in an authorised request (idle, or still sending its headers), or
itself when every one is. A client without the key therefore cannot keep a keyed client out.
"""

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

# Connections take at most 1/FD_SHARE of the open-file limit, and so does one burst of accepts (asyncio accepts
# up to the listen backlog at once, and a connection it closes frees its descriptor only on the next loop turn);
# the model's files, shared memory and weight-sync groups keep the rest.
FD_SHARE = 4
MAX_BACKLOG = 128  # aiohttp's listen backlog
LOG_INTERVAL_S = 10.0  # at most one line per kind of event in this interval, with the count since the last


def open_file_limit() -> int:
    """This process's open-file limit (RLIMIT_NOFILE), raised to its hard limit first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(configured: int) -> int:
    """`configured`, at most a quarter of the open-file limit (RLIMIT_NOFILE, raised to its hard limit)."""
    return max(1, min(configured, open_file_limit() // FD_SHARE))


def listen_backlog() -> int:
    """The listen backlog: aiohttp's, at most a quarter of the open-file limit."""
    return max(1, min(MAX_BACKLOG, open_file_limit() // FD_SHARE))


class RateLimitedLog:
    """Logs an event at most once per `interval_s` per key, with how many were held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" ({held} more like it in the last {self.interval_s:g} s)" if held else ""
        self.logger.warning(message + suffix, *args)


class ConnectionGuard:
    """Counts the connections of one aiohttp `Server` and keeps them at or below `cap`."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.evicted = 0  # connections closed to make room (or refused)
        self._open: dict[RequestHandler, None] = {}  # in arrival order
        self._busy: set[RequestHandler] = set()  # in an authorised request: never evicted
        self._log = RateLimitedLog(log)

    def attach(self, server: web.Server) -> None:
        """Hook `server`'s connection bookkeeping (aiohttp calls it for every connection)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._opened(handler)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            self._open.pop(handler, None)
            self._busy.discard(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    @property
    def open(self) -> int:
        return len(self._open)

    def _opened(self, handler: RequestHandler) -> None:
        self._open[handler] = None
        if len(self._open) <= self.cap:
            return
        victim = next((h for h in self._open if h not in self._busy and h is not handler), handler)
        self._open.pop(victim, None)
        self.evicted += 1
        what = "the newest (every other one is in a request)" if victim is handler else "the oldest idle one"
        self._log.warning("cap", "%d connections is this server's cap: closed %s", self.cap, what)
        victim.force_close()

    def busy(self, request: web.Request) -> Callable[[], None]:
        """Mark `request`'s connection as in an authorised request; call the result when it is answered."""
        handler = request.protocol
        if not isinstance(handler, RequestHandler):
            return lambda: None
        self._busy.add(handler)
        return lambda: self._busy.discard(handler)


def rate_limited_exception_handler(loop: asyncio.AbstractEventLoop) -> None:
    """Make `loop` log each kind of unhandled error (asyncio's accept errors at the file-descriptor limit: one
    traceback per refused connection) at most once per LOG_INTERVAL_S, without the traceback after the first."""
    limited = RateLimitedLog(logging.getLogger("asyncio"))
    seen: set[str] = set()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "unhandled error"))
        error = context.get("exception")
        key = f"{message}: {type(error).__name__}" if error is not None else message
        if key not in seen:
            seen.add(key)
            loop.default_exception_handler(context)
            return
        limited.warning(key, "%s%s", message, f": {error}" if error is not None else "")

    loop.set_exception_handler(handle)
