"""Worker replicas found by DNS (`worker_dns`): every A/AAAA record of a name is one replica's
rank-0 address on the configured port, as a Kubernetes headless Service lists its ready pods.

The name is resolved with the system resolver (`getaddrinfo` in a thread of the loop's
executor) every `worker_dns_refresh_s`, not with gRPC's own `dns:` resolver: a gRPC channel
to `dns:///name` balances calls over the addresses it finds and never says which they are,
but each replica here is stateful (its own block pool, its own prefix cache in the router),
so the scheduler needs the addresses themselves, one channel each. The system resolver also
reads /etc/hosts and the pod's resolv.conf search path as every other program on the host.

A lookup that fails for a transient reason (no answer, a server failure) changes nothing: a
flaky resolver must not take every replica away. A name that has no records (NXDOMAIN, or
no A/AAAA) is an answer: no replicas behind it.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

import structlog

log = structlog.get_logger("scheduler_svc.replicas.discovery")

# getaddrinfo's "this name has no addresses" answers; any other error is a failed lookup.
NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def split_host_port(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` (config.validate checked the form)."""
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def format_address(ip: str, port: int) -> str:
    """A gRPC target for one resolved address: IPv6 in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(target: str) -> list[str] | None:
    """The addresses behind `host:port`, sorted, one per distinct A/AAAA record; [] when the name
    has none; None when the lookup failed (keep what we have)."""
    host, port = split_host_port(target)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_RECORDS:
            return []
        log.warning("worker_dns lookup failed; keeping the replicas found before", target=target, error=str(exc))
        return None
    return sorted({format_address(str(info[4][0]), port) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)})


async def watch_dns(target: str, refresh_s: float, update: Callable[[list[str]], Awaitable[None]]) -> None:
    """Resolve `target` every `refresh_s` and hand each answer (never a failed lookup) to `update`."""
    while True:
        addresses = await resolve(target)
        if addresses is not None:
            await update(addresses)
        await asyncio.sleep(refresh_s)
