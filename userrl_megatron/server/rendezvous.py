"""A weight-update group's rendezvous as the engine reaches it: arguments checked before anything waits, and the
trainer's store found listening."""

import asyncio
import contextlib
import socket

from userrl_megatron.server.threads import start_daemon

GROUP_BACKENDS = ("gloo", "nccl")  # what a weight-update group may use here
MAX_GROUP_WORLD = 1 << 16  # ranks of a weight-update group
MAX_ADDRESS_CHARS = 255  # a DNS name's length


def check_group_args(address: str, port: int, rank: int, world_size: int, backend: str, device: str) -> None:
    """ValueError for a group join that cannot succeed, before anything waits: the backend (gloo, or nccl on a
    GPU), the port, the world size (the trainer's rank 0 and at least this engine) and this engine's rank."""
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(GROUP_BACKENDS)}, got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"backend nccl needs the engine on a GPU; this one runs on {device} (use gloo)")
    if not address or len(address) > MAX_ADDRESS_CHARS or any(c.isspace() or c == "\x00" for c in address):
        raise ValueError(f"master_address must be a host name or IP address, got {address[:80]!r}")
    if not 1 <= port <= 65535:
        raise ValueError(f"master_port must be in [1, 65535], got {port}")
    if not 2 <= world_size <= MAX_GROUP_WORLD:
        raise ValueError(f"world_size must be in [2, {MAX_GROUP_WORLD}] (the trainer and engines), got {world_size}")
    if not 1 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the engines' ranks [1, {world_size - 1}] (world_size {world_size})")


async def listening(address: str, port: int) -> tuple[str, int, socket.AddressFamily]:
    """The resolved (host, port, family) once a TCP connection to address:port succeeds (the trainer's
    rendezvous store is up), retrying while it is refused. Name resolution runs in a daemon thread (the loop's
    executor is joined at exit)."""
    infos = await asyncio.wrap_future(
        start_daemon(lambda: socket.getaddrinfo(address, port, type=socket.SOCK_STREAM), "resolve")
    )
    family, _, _, _, where = infos[0]
    host, resolved_port = where[0], where[1]
    assert isinstance(host, str) and isinstance(resolved_port, int)  # an AF_INET or AF_INET6 address
    delay = 0.05
    while True:
        try:
            _, writer = await asyncio.open_connection(host, resolved_port, family=family)
        except OSError:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return host, resolved_port, family
