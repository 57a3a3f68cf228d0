"""The ports of the engine processes, handed out centrally: each engine of a run gets a block of ports of its own,
the same on every node it spans, and its processes take theirs from it.

SGLang 0.5.23 picks the port of its torch.distributed rendezvous at start-up unless told one (`--nccl-port`): a
random port of 22000-29999 that is free then, bound by a scheduler process only later
(srt/server_args.py:771-773, srt/utils/network.py:205-224; the rendezvous is at it on the server's host,
srt/distributed/bootstrap.py:233-248, unless `--dist-init-addr` names one). Two engines starting on one node at
the same moment can both find the same port free, and the second fails to bind it; the engines' HTTP ports
(`base_port` 0) and a multi-node engine's `--dist-init-addr` port were drawn the same way (`ports.free_port`).
Here the pool gives engine e a block of `BLOCK` ports of `ports.PORTS` no other engine of the run gets
(`PortBook`, one per driver process, so the policy's and the user simulator's engines never share one either),
and each of its processes takes the ports it needs from that block, the first ones free on its node
(`PortBlock.take`): a port something else holds is skipped, never shared with another engine. A restarted engine
takes from the same block. The first block is drawn at random, so two runs sharing a node rarely line up.
"""

import random
import socket
from dataclasses import dataclass

from userrl_megatron.ports import PORTS

BLOCK = 8  # ports per engine: SGLang's node rank 0 needs 3 (HTTP, --nccl-port, --dist-init-addr), the rest spare


@dataclass(frozen=True)
class PortBlock:
    """`size` consecutive ports from `start`, one engine's on every node it runs on."""

    start: int
    size: int = BLOCK

    def take(self, count: int, host: str = "") -> list[int]:
        """The first `count` ports of the block that could be bound on `host` ("" for every interface) a moment
        ago; raises RuntimeError when fewer are free."""
        free: list[int] = []
        for port in range(self.start, self.start + self.size):
            if len(free) == count:
                break
            if bindable(host, port):
                free.append(port)
        if len(free) < count:
            raise RuntimeError(
                f"engine ports {self.start}-{self.start + self.size - 1}: {count} needed, {len(free)} free on this node"
            )
        return free


class PortBook:
    """Hands out the blocks of `ports.PORTS` in turn, from a random first one, wrapping around."""

    def __init__(self, first: int | None = None) -> None:
        self.blocks = len(PORTS) // BLOCK
        self.next = random.SystemRandom().randrange(self.blocks) if first is None else first

    def block(self) -> PortBlock:
        """A block no earlier call returned (until all `len(PORTS) // BLOCK` are out)."""
        index, self.next = self.next % self.blocks, self.next + 1
        return PortBlock(PORTS.start + index * BLOCK)


BOOK = PortBook()  # the driver's: every pool of the run draws its engines' blocks from it


def bindable(host: str, port: int) -> bool:
    """Whether `port` could be bound on `host` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
