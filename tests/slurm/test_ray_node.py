"""slurm/ray_node.sh's network choice, golden: the address a node gives Ray and the interface variables `ray start`
(and so every Ray worker: actor ranks, engines) receives, on fake hosts.

Fake `ip`, `hostname` and `ray` on PATH stand for a host's interfaces, its name's resolution and Ray: the fake
`ray start` prints the address it was given and GLOO/NCCL/TP_SOCKET_IFNAME as it sees them. No Slurm, no root.
"""

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.tiny_run import REPO

# `ip -o -4 addr show` of the hosts below (one line per address, as iproute2 prints it).
STOCK_UBUNTU = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eno1    inet 10.0.0.5/24 brd 10.0.0.255 scope global eno1\\       valid_lft forever preferred_lft forever
3: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever preferred_lft forever
"""
WITH_IB = (
    STOCK_UBUNTU + "4: ib0    inet 192.168.50.7/24 brd 192.168.50.255 scope global ib0\\       valid_lft forever\n"
)

FAKE_IP = r"""#!/usr/bin/env bash
# ip -o -4 addr show [dev IF] | ip -4 -o addr show [dev IF] | ip -4 route get ADDR
args=" $* "
if [[ $args == *" route get "* ]]; then
  printf '%s\n' "$FAKE_ROUTE"
  exit 0
fi
dev=""
if [[ $args == *" dev "* ]]; then dev=${args##* dev }; dev=${dev%% *}; fi
printf '%s' "$FAKE_ADDRS" | while IFS= read -r line; do
  [ -z "$dev" ] || [ "$(echo "$line" | awk '{print $2}')" = "$dev" ] && echo "$line"
done
exit 0
"""
FAKE_HOSTNAME = r"""#!/usr/bin/env bash
case "${1:-}" in
  -s) echo node1 ;;
  --ip-address | -i) echo "$FAKE_RESOLVED" ;;
  -I) echo "$FAKE_ALL" ;;
  *) echo node1.cluster ;;
esac
"""
FAKE_RAY = r"""#!/usr/bin/env bash
for arg in "$@"; do case "$arg" in --node-ip-address=*) echo "ray start at ${arg#*=}" ;; esac; done
for name in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME TP_SOCKET_IFNAME; do echo "$name=${!name-<unset>}"; done
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in {"ip": FAKE_IP, "hostname": FAKE_HOSTNAME, "ray": FAKE_RAY}.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def _ray_node(fake_bin: Path, role: str, **env: str) -> tuple[list[str], str]:
    """Run slurm/ray_node.sh ROLE on the fake host; the fake `ray start`'s lines, and stderr."""
    base = {
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "USERRL_RAY_TMP": str(fake_bin.parent / "userrl-ray-1"),
        "USERRL_RAY_PORT": "20000",
        "USERRL_RAY_CPUS": "2",
        "FAKE_RESOLVED": "127.0.1.1",  # stock Ubuntu's /etc/hosts: the host name on a loopback address
        "FAKE_ALL": "10.0.0.5 172.17.0.1",
        "FAKE_ADDRS": STOCK_UBUNTU,
        "FAKE_ROUTE": "",
    }
    done = subprocess.run(
        ["bash", "slurm/ray_node.sh", role], cwd=REPO, env={**base, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ray start at", "GLOO", "NCCL", "TP_"))]
    return lines, done.stderr


def golden(ip: str, gloo: str, nccl: str, tp: str) -> list[str]:
    return [f"ray start at {ip}", f"GLOO_SOCKET_IFNAME={gloo}", f"NCCL_SOCKET_IFNAME={nccl}", f"TP_SOCKET_IFNAME={tp}"]


def test_head_on_stock_ubuntu_binds_to_the_interface_of_its_address(fake_bin: Path) -> None:
    # The host name resolves to 127.0.1.1: Ray gets the first address of `hostname -I`, gloo the same interface.
    assert _ray_node(fake_bin, "head")[0] == golden("10.0.0.5", "eno1", "=eno1", "eno1")


def test_worker_binds_to_the_interface_of_its_route_to_the_head(fake_bin: Path) -> None:
    lines, _ = _ray_node(
        fake_bin,
        "worker",
        RAY_HEAD_IP="192.168.50.1",
        FAKE_ADDRS=WITH_IB,
        FAKE_ROUTE="192.168.50.1 dev ib0 src 192.168.50.7 uid 0",
    )
    assert lines == golden("192.168.50.7", "ib0", "=ib0", "ib0")


def test_userrl_net_if_wins(fake_bin: Path) -> None:
    lines, _ = _ray_node(fake_bin, "head", USERRL_NET_IF="ib0", FAKE_ADDRS=WITH_IB, NCCL_SOCKET_IFNAME="eno")
    assert lines == golden("192.168.50.7", "ib0", "ib0", "ib0")


def test_a_variable_already_set_is_kept(fake_bin: Path) -> None:
    lines, _ = _ray_node(fake_bin, "head", NCCL_SOCKET_IFNAME="^docker,lo", GLOO_SOCKET_IFNAME="eno1")
    assert lines == golden("10.0.0.5", "eno1", "^docker,lo", "eno1")


def test_an_address_on_no_interface_exports_nothing_and_says_so(fake_bin: Path) -> None:
    lines, stderr = _ray_node(fake_bin, "head", FAKE_RESOLVED="203.0.113.9")
    assert lines == golden("203.0.113.9", "<unset>", "<unset>", "<unset>")
    assert "ray_node[node1]: no interface here holds 203.0.113.9 (ip -o -4 addr show)" in stderr
