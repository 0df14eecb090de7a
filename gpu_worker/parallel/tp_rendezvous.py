"""Where the tensor-parallel ranks of one replica meet: `hetero-infer serve`'s rendezvous file
(every rank on this host), or `tp_init_method`, a torch.distributed init method such as
`tcp://<rank 0's address>:29500` (a TCP store served by rank 0), for ranks on different hosts.

gloo (the CPU backend) also needs to know which interface to talk on: unless GLOO_SOCKET_IFNAME
says, it binds to the address its host name resolves to, which is often loopback (a pod's or a
VM's /etc/hosts) and then the other hosts cannot reach it (the group never forms: seen with two
network namespaces). So for a tcp:// rendezvous we pick the interface that routes to rank 0's
address, as the kernel would for a connection there.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from urllib.parse import urlsplit

import structlog

log = structlog.get_logger("gpu_worker.parallel.tp_rendezvous")

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def init_method(init_file: str | None, configured: str) -> str | None:
    """The init method for torch.distributed: the file `serve` passed (ranks on one host) first,
    else the configured one; None when neither is set."""
    if init_file:
        return f"file://{init_file}"
    return configured or None


def interface_towards(host: str) -> str | None:
    """The name of the local IPv4 interface that traffic to `host` leaves from, or None (no route,
    IPv6, not Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # a UDP connect only picks the route and source address; nothing is sent
            source = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address on this one
            if socket.inet_ntoa(packed[20:24]) == source:
                return name
    except OSError:
        return None
    return None


def prepare_gloo(method: str) -> None:
    """Set GLOO_SOCKET_IFNAME for a tcp:// rendezvous, unless the user set it."""
    if not method.startswith("tcp://") or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    host = urlsplit(method).hostname
    name = interface_towards(host) if host else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo interface", interface=name, rank0=host)
