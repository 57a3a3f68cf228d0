"""A TCP peer that accepts and never answers: the worst case of a group join's rendezvous."""

import contextlib
import socket
import threading


class SilentListener:
    """A TCP port that accepts connections and never answers: a group join naming it blocks inside torch's
    rendezvous (the worst case: the join has left the cancellable wait for the port to listen)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._spoke: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def received(self) -> int:
        """Connections that have sent something (torch's store client does; the port probe only connects), also
        those reset since (an abandoned join's)."""
        for conn in self.accepted:
            if conn not in self._spoke:
                conn.setblocking(False)
                with contextlib.suppress(BlockingIOError, ConnectionResetError):
                    if conn.recv(1, socket.MSG_PEEK):
                        self._spoke.add(conn)
        return len(self._spoke)

    def close(self) -> None:
        for conn in self.accepted:
            conn.close()
        self.sock.close()
