"""The multi-host harness itself (tests/helpers/netns.py): hosts reach each other and the test process,
a cut link drops packets and comes back, /etc/hosts per host, and nothing is left behind (after
a failure, or by a run that was killed). Skipped where namespaces cannot be made."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.netns import NETNS_ETC, NS_PREFIX, Network, _ip, network, remove_stale  # noqa: F401  (a fixture)

ECHO_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hi"); c.close()
"""


def _ours() -> tuple[set[str], set[str]]:
    namespaces = {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.startswith(NS_PREFIX)}
    links = {line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link").stdout.splitlines()}
    return namespaces, links


def test_hosts_talk_a_cut_link_drops_and_comes_back(network: Network) -> None:
    a, b = network.add_host("a"), network.add_host("b")
    server = a.popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline() == b"listening\n"
    assert socket.create_connection((a.address, 7000), timeout=5).recv(2) == b"hi"  # from the test process
    fetch = [sys.executable, "-c", f"import socket; print(socket.create_connection(('{a.address}', 7000), timeout=2).recv(2))"]
    assert b.run(fetch).stdout.strip() == "b'hi'"  # host to host
    a.cut()
    with pytest.raises(OSError):  # dropped, not refused: the connect times out
        socket.create_connection((a.address, 7000), timeout=1)
    a.restore()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert socket.create_connection((a.address, 7000), timeout=1).recv(2) == b"hi"
            break
        except OSError:
            assert time.monotonic() < deadline
    b.set_hosts({"replicas.test": [a.address, b.address]})
    resolve = [sys.executable, "-c", "import socket; print(sorted({x[4][0] for x in socket.getaddrinfo('replicas.test', 1, proto=6)}))"]
    assert b.run(resolve).stdout.strip() == str(sorted([a.address, b.address]))


def test_everything_is_removed_after_a_failure() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces: not root")
    with pytest.raises(RuntimeError):
        with Network.create() as net:
            host = net.add_host("x")
            host.set_hosts({})
            process = host.popen(["sleep", "60"])
            raise RuntimeError("a test failed")
    assert process.poll() is not None
    namespaces, links = _ours()
    assert host.netns not in namespaces and net.bridge not in links and host.port_side not in links
    assert not (NETNS_ETC / host.netns).exists()


def test_what_a_killed_run_left_is_removed() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces: not root")
    dead_pid = 2_000_000_000  # above any pid_max (at most 2^22): no such process
    netns, bridge = f"{NS_PREFIX}{dead_pid}-fedcba-x", "hbfedcba"
    _ip("netns", "add", netns)
    _ip("link", "add", bridge, "type", "bridge")
    remove_stale()
    namespaces, links = _ours()
    assert netns not in namespaces and bridge not in links
