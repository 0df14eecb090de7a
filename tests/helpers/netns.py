"""Hosts on one machine for multi-host tests: Linux network namespaces joined by veth pairs to a
bridge, each with its own private address, with helpers to run processes on a "host", cut or
restore its link, delay its traffic (netem) and give it an /etc/hosts.

    with Network.create() as net:            # or the `network` fixture below
        a = net.add_host("worker-a")          # a namespace, its veth, an address 10.218.N.2
        p = a.popen([sys.executable, ...])    # runs inside a's namespace (ip netns exec)
        a.cut(); a.restore()                  # ip link set <a's bridge port> down / up
        a.set_hosts({"workers.test": [a.address]})

Every name carries this run's tag (interfaces: at most 15 characters), and the namespaces carry the
pid of the process that made them: a later run deletes what a crashed (killed) run left behind. The
subnet is 10.218.N.0/24, N chosen at random among those not in use on this machine. The root
namespace holds the bridge's address (.1), so the test process reaches every host directly.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

NS_PREFIX = "hetero-t"  # namespaces: hetero-t<pid>-<tag>-<host>
NETNS_ETC = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/<file> over /etc/<file>


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "network namespaces: the `ip` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces: not root (ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"network namespaces: `ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL what still runs in one of our namespaces (processes a test started there)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale() -> None:
    """Delete the namespaces, bridges and /etc/netns entries of runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NS_PREFIX}(\d+)-([0-9a-f]+)-.*", name)
        if match is None or _alive(int(match.group(1))):
            continue
        _kill_namespace_processes(name)
        _ip("netns", "del", name, check=False)  # takes its veth pair with it
        _ip("link", "del", f"hb{match.group(2)}", check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def _subnets_in_use() -> set[int]:
    used = set()
    for m in re.finditer(r"10\.218\.(\d+)\.", _ip("-4", "addr", check=False).stdout + _ip("-4", "route", check=False).stdout):
        used.add(int(m.group(1)))
    return used


def netem_reason() -> str | None:
    """Why `tc ... netem` cannot delay traffic here, or None when it can (probed on a throwaway veth)."""
    if shutil.which("tc") is None:
        return "netem: the `tc` command is missing"
    name = f"hn{random.getrandbits(24):06x}"
    _ip("link", "add", name, "type", "veth", "peer", "name", name + "p", check=False)
    try:
        result = subprocess.run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"],
                                capture_output=True, text=True)
        return None if result.returncode == 0 else f"netem: this kernel cannot add it ({result.stderr.strip()})"
    finally:
        _ip("link", "del", name, check=False)


@dataclass
class Host:
    """One namespace: a "host" with one link (a veth pair to the bridge) and one address."""

    network: "Network" = field(repr=False)
    name: str
    netns: str
    address: str
    port_side: str  # the veth end on the bridge: what cut() takes down

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
        """Start a process inside this host's namespace; the network stops it on close."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.network.processes.append(process)
        return process

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), capture_output=True, text=True, check=True)

    def cut(self) -> None:
        """Take the link down at the bridge: packets are dropped, no reset is sent (a pulled cable)."""
        _ip("link", "set", self.port_side, "down")

    def restore(self) -> None:
        _ip("link", "set", self.port_side, "up")

    def delay(self, ms: float) -> None:
        """netem: every packet leaving this host waits `ms` (one delay per link and direction of
        a host-to-host hop: the packet's sender delays it). Raises when the kernel has no netem."""
        self.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"])

    def clear_delay(self) -> None:
        subprocess.run(self.command(["tc", "qdisc", "del", "dev", "eth0", "root"]), capture_output=True)

    def set_hosts(self, names: dict[str, list[str]]) -> None:
        """This host's /etc/hosts: each name with its addresses (several = several A records; glibc
        returns them all with `multi on`, Debian's default). Written in place, so processes already
        running in the namespace (a bind mount of this file) read the new entries at their next lookup."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{address} {name}" for name, addresses in names.items() for address in addresses]
        path = NETNS_ETC / self.netns / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Names come from this file alone (no DNS server is reachable from the namespace): a name
        # not in it is "no such name" at once, as a headless Service without endpoints answers,
        # not "try again" after a resolver's timeout. Read at exec, so set hosts before starting.
        nsswitch = Path("/etc/nsswitch.conf")
        others = [l for l in nsswitch.read_text().splitlines() if not l.startswith("hosts:")] if nsswitch.exists() else []
        (path.parent / "nsswitch.conf").write_text("\n".join(["hosts: files", *others]) + "\n")
        with open(path, "a+") as f:  # same inode: the bind mount follows it
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")


@dataclass
class Network:
    tag: str
    subnet: int  # the N of 10.218.N.0/24
    bridge: str
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def create(cls) -> "Network":
        remove_stale()
        free = sorted(set(range(1, 255)) - _subnets_in_use())
        if not free:
            raise RuntimeError("no free 10.218.N.0/24 subnet")
        tag = f"{random.getrandbits(24):06x}"
        net = cls(tag, random.choice(free), f"hb{tag}")
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.gateway_address}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except BaseException:
            net.close()
            raise
        return net

    @property
    def gateway_address(self) -> str:
        """The root namespace's address on the bridge (where the test process talks from)."""
        return f"10.218.{self.subnet}.1"

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        netns = f"{NS_PREFIX}{os.getpid()}-{self.tag}-{name}"
        port_side, far_side = f"hv{self.tag}{index:x}", f"hp{self.tag}{index:x}"
        host = Host(self, name, netns, f"10.218.{self.subnet}.{index + 2}", port_side)
        self.hosts.append(host)  # before it exists: close() removes whatever part was made
        _ip("netns", "add", netns)
        _ip("link", "add", port_side, "type", "veth", "peer", "name", far_side)
        _ip("link", "set", far_side, "netns", netns)
        _ip("link", "set", port_side, "master", self.bridge)
        _ip("link", "set", port_side, "up")
        for args in (("link", "set", far_side, "name", "eth0"), ("addr", "add", f"{host.address}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
            _ip("-n", netns, *args)
        return host

    def close(self) -> None:
        """Stop every process started on a host, then delete the namespaces and the bridge."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for host in self.hosts:
            _kill_namespace_processes(host.netns)  # e.g. a child of `ip netns exec` that outlived it
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.port_side, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def network_or_skip() -> Network:
    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return Network.create()


@pytest.fixture
def network() -> Iterator[Network]:
    """A fresh network for one test, always removed afterwards (also when the test fails)."""
    with network_or_skip() as net:
        yield net
