"""A loopback port that relays one group join's store traffic, so that the join can be cancelled.

torch's store client blocks in socket calls that nothing in the process can interrupt: `TCPStore`'s constructor
waits for the server's reply to its ping with no timeout at all (torch 2.13), so a join naming a port that
accepts and never answers holds its thread forever. The join's store client connects to a `StoreRelay`
instead, which copies bytes to and from the trainer's store. `cut()` resets every relayed connection and every
later one: the client's blocked call fails at once. The constructor retries a failed connection until its own
timeout, so `open_store` builds the client with a timeout of STORE_SLICE_S, again while the relay is not cut and
the join's time lasts: a cut join gives up within a slice and one of torch's back-off pauses.
"""

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

CHUNK = 1 << 16  # bytes copied per read
STORE_SLICE_S = 1.0  # the store client's timeout while it connects: how long a cut join goes on trying


class StoreRelay:
    """Loopback port `port` relaying each connection to `host`:`port` of family `family`, until `stop()`."""

    def __init__(self, host: str, port: int, family: socket.AddressFamily) -> None:
        self._upstream = (host, port, family)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._cut = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.is_cut = False
        self._thread = threading.Thread(target=self._run, name="store-relay", daemon=True)
        self._thread.start()

    def open_store(self, world_size: int, timeout: timedelta) -> dist.TCPStore:
        """A store client of a non-zero rank through the relay (what torch's tcp:// rendezvous builds), with
        `timeout` for its operations; it gives up connecting after `timeout`, or soon after `cut()`."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            connect_s = min(STORE_SLICE_S, max(deadline - time.monotonic(), 0.001))
            try:
                store = dist.TCPStore(
                    "127.0.0.1", self.port, world_size, False, timedelta(seconds=connect_s), multi_tenant=True
                )
            except dist.DistError:
                if self.is_cut or time.monotonic() >= deadline:
                    raise
                continue
            store.set_timeout(timeout)
            return store

    def cut(self) -> None:
        """Reset every relayed connection and every later one (idempotent, from any thread)."""
        self.is_cut = True
        self._call(self._cut.set)

    def stop(self) -> None:
        """Cut, close the port and end the relay's thread (idempotent, from any thread)."""
        self.cut()
        self._call(self._stop.set)

    def _call(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has already ended
            self._loop.call_soon_threadsafe(fn)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._listener.setblocking(False)
        accepting = asyncio.ensure_future(self._accept())
        try:
            await self._stop.wait()
        finally:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)
            self._listener.close()
            await asyncio.gather(*self._tasks, return_exceptions=True)  # each ends: the relay is cut

    async def _accept(self) -> None:
        """Hand each connection to a relay task, registered at once: every accepted connection is closed."""
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = asyncio.ensure_future(self._relay(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _relay(self, conn: socket.socket) -> None:
        host, port, family = self._upstream
        futures: list[asyncio.Future[Any]] = []
        writer: asyncio.StreamWriter | None = None
        connect: asyncio.Future[Any] | None = None
        try:
            if self._cut.is_set():
                return
            reader, writer = await asyncio.open_connection(sock=conn)
            cut: asyncio.Future[Any] = asyncio.ensure_future(self._cut.wait())
            connect = asyncio.ensure_future(asyncio.open_connection(host, port, family=family))
            futures += [cut, connect]
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
            if _succeeded(connect) and not cut.done():
                up_reader, upstream = connect.result()
                copies = [
                    asyncio.ensure_future(_copy(reader, upstream)),
                    asyncio.ensure_future(_copy(up_reader, writer)),
                ]
                futures += copies
                await asyncio.wait([cut, *copies], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in futures:
                future.cancel()
            if writer is not None:
                writer.transport.abort()  # a reset, not a graceful close: the client sees it at once
            else:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
                conn.close()
            await asyncio.gather(*futures, return_exceptions=True)
            if connect is not None and _succeeded(connect):
                connect.result()[1].transport.abort()


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy `reader` into `writer` until end of stream or an error."""
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
