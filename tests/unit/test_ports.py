"""`userrl_megatron.ports.free_port`: a port outside the ephemeral range that can be bound, never a taken one."""

import socket

import pytest

from userrl_megatron import ports


def test_a_drawn_port_is_in_the_range_and_can_be_bound() -> None:
    port = ports.free_port()
    assert port in ports.PORTS
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_someone_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken, 20001])
        monkeypatch.setattr(ports._draw, "choice", lambda _: next(draws))
        assert ports.free_port() == 20001


def test_a_range_with_no_free_port_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "PORTS", range(taken, taken + 1))
        with pytest.raises(RuntimeError, match=rf"^no free port in {taken}-{taken} on 127.0.0.1$"):
            ports.free_port()
