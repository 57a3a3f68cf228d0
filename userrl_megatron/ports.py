"""Free TCP ports for the servers and process groups a run starts.

A port from `bind(0)` is ephemeral: the kernel hands out the same range (32768-60999 on Linux) to outgoing
connections, so one can take the port between the check and the server's own bind ("address already in use").
Ports are drawn at random from `PORTS` instead, below the ephemeral range and above Ray's worker ports
(10002-19999), and checked free on the address they will be bound to."""

import random
import socket

PORTS = range(20000, 30000)
_draw = random.SystemRandom()  # unaffected by code that seeds `random`
ATTEMPTS = 1000


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `PORTS` that could be bound on `host` ("" for every interface) a moment ago."""
    for _ in range(ATTEMPTS):
        port = _draw.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1} on {host or 'any address'}")
