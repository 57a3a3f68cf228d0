"""The engines' ports, handed out by the pool (`fleet/engine_ports.py`): each engine takes its HTTP port, SGLang's
`--nccl-port` and a multi-node engine's `--dist-init-addr` port from a block of its own (item 4 of issue 56: two
engines starting on one node at the same moment picked their rendezvous ports themselves, and could pick the same)."""

import socket
from dataclasses import replace

import pytest
import ray

from userrl_megatron.config.schema import RolloutConfig, SGLangConfig
from userrl_megatron.fleet.engine_ports import BLOCK, PortBlock, PortBook
from userrl_megatron.fleet.pool import EngineLaunch, EngineServer, RolloutPool
from userrl_megatron.ports import PORTS


def started(launch: EngineLaunch) -> list[str]:
    """The command line a dry start of `launch` records."""
    server = EngineServer(replace(launch, dry=True))
    server.start()
    [process] = server.started
    return process.launch.command


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry start without followers asks Ray for nothing (`ray.get([])` would start a local Ray)."""
    monkeypatch.setattr(ray, "get", lambda refs: [])


def test_two_engines_on_one_node_get_ports_of_their_own() -> None:
    cfg = RolloutConfig(backend="sglang", num_engines=2, sglang=SGLangConfig(python="py", base_port=0))
    pool = RolloutPool(cfg, "/m", "bfloat16")
    commands = [started(replace(pool._launch(e), gpus=[str(e)])) for e in range(2)]
    ports = [(int(option(c, "--port")), int(option(c, "--nccl-port"))) for c in commands]
    blocks = [pool._launch(e).ports for e in range(2)]
    for (http, nccl), block in zip(ports, blocks, strict=True):
        assert block is not None and {http, nccl} <= set(range(block.start, block.start + BLOCK))
    assert len({p for pair in ports for p in pair}) == 4
    assert pool._launch(0, restarted=True).ports == blocks[0]  # a restarted engine keeps its block
    other = RolloutPool(cfg, "/m", "bfloat16")  # e.g. the user simulator's engines beside the policy's
    assert not {other._launch(e).ports for e in range(2)} & set(blocks)


def test_a_fixed_base_port_stays_and_a_spanning_engine_rendezvouses_in_its_block() -> None:
    cfg = RolloutConfig(backend="sglang", engine_tp=16, sglang=SGLangConfig(python="py", base_port=30000))
    launch = replace(RolloutPool(cfg, "/m", "bfloat16")._launch(0), nnodes=2, gpus=[str(g) for g in range(8)])
    command = started(launch)
    assert launch.ports is not None and option(command, "--port") == "30000"
    block = range(launch.ports.start, launch.ports.start + BLOCK)
    port = int(option(command, "--dist-init-addr").rsplit(":", 1)[1])
    nccl = int(option(command, "--nccl-port"))
    assert port in block and nccl in block and port != nccl


def test_an_embedded_engine_takes_its_http_port_from_its_block() -> None:
    pool = RolloutPool(RolloutConfig(num_engines=1), "/m", "float32")
    command = started(pool._launch(0))
    block = pool._launch(0).ports
    assert block is not None and int(option(command, "--port")) in range(block.start, block.start + BLOCK)
    assert "--nccl-port" not in command


def test_the_book_hands_out_every_block_once_then_wraps() -> None:
    book = PortBook(first=len(PORTS) // BLOCK - 1)
    assert [book.block().start for _ in range(3)] == [PORTS.stop - BLOCK, PORTS.start, PORTS.start + BLOCK]
    drawn = PortBook().block().start
    assert drawn in PORTS and (drawn - PORTS.start) % BLOCK == 0


def test_a_block_skips_a_port_something_else_holds() -> None:
    block = PortBook().block()
    with socket.socket() as held:
        held.bind(("", block.start + 1))
        held.listen()
        free = block.take(3)
        assert block.start + 1 not in free and free == sorted(free) and len(free) == 3
        with pytest.raises(RuntimeError, match=rf"^engine ports {block.start}-{block.start + BLOCK - 1}: 8 needed, "):
            block.take(BLOCK)
    assert PortBlock(block.start).take(1) == [block.start]
