"""What every gRPC server of the stack gets: health service, reflection, error mapping."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
from pathlib import Path
from typing import Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hetero_common.config import Config, ServingConfig, TLSConfig
from hetero_common.errors import HeteroError, grpc_status_for

# Large enough for a step plan with thousands of prompt tokens; protobuf's own limit is 2 GiB.
MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
# Internal links reconnect fast: a restarted scheduler or worker is back within seconds, and
# gRPC's default backoff (growing to 2 minutes) would keep a healthy peer out of reach.
INTERNAL_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200),
                            ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


def _with(options: list[tuple[str, int]], overrides: dict[str, int]) -> list[tuple[str, int]]:
    """`options` with some keys replaced (gRPC would not say which of two equal keys wins)."""
    return [(k, v) for k, v in options if k not in overrides] + list(overrides.items())


def internal_channel_options(config: Config) -> list[tuple[str, int]]:
    """The internal links' client side: a keepalive ping after `internal_keepalive_s` without data
    received, and the link closed (its calls fail UNAVAILABLE) when the ping is not answered
    within as long again; so a peer behind a cut link (no RST) is noticed within about
    2 x internal_keepalive_s, not at the TCP timeout. Pings go also with no call open (an idle
    replica is watched too) and with no data sent (max_pings_without_data 0 = no limit)."""
    ms = max(1, int(config.internal_keepalive_s * 1000))
    return _with(INTERNAL_CHANNEL_OPTIONS, {"grpc.keepalive_time_ms": ms, "grpc.keepalive_timeout_ms": ms,
                                            "grpc.keepalive_permit_without_calls": 1,
                                            "grpc.http2.max_pings_without_data": 0, "grpc.http2.ping_timeout_ms": ms})


def internal_server_options(config: Config) -> list[tuple[str, int]]:
    """The internal servers' side (scheduler, worker): accept a ping every internal_keepalive_s
    (gRPC's default policy answers pings more often than every 5 minutes without data with a
    GOAWAY "too_many_pings", which would cut the link the pings are there to watch), and ping
    idle clients at the same rate, so a dead client's connection is closed too."""
    ms = max(1, int(config.internal_keepalive_s * 1000))
    return _with(CHANNEL_OPTIONS, {"grpc.keepalive_time_ms": ms, "grpc.keepalive_timeout_ms": ms,
                                   "grpc.keepalive_permit_without_calls": 1, "grpc.http2.max_pings_without_data": 0,
                                   "grpc.http2.min_recv_ping_interval_without_data_ms": max(1, ms // 2),
                                   "grpc.http2.min_ping_interval_without_data_ms": max(1, ms // 2),
                                   "grpc.http2.max_ping_strikes": 0})


def public_server_options(serving: ServingConfig) -> list[tuple[str, int]]:
    """The gateway's public gRPC server: a message over `serving.max_request_bytes` is refused by
    gRPC itself with RESOURCE_EXHAUSTED ("Received message larger than max (N vs. CAP)") before
    it is read on (internal links keep MESSAGE_LIMIT_BYTES); a connection beyond
    `serving.max_connections` is closed at accept; one with no call open for
    `serving.grpc_idle_timeout_s` gets GOAWAY; one that has not finished its (TLS and HTTP/2)
    handshake within `serving.http_header_timeout_s` is closed; one connection carries at most
    `serving.grpc_max_concurrent_streams` calls at once. gRPC's own defaults bound the rest:
    metadata (headers) at 8 KiB, and pings without data (a client pinging more often than every
    5 minutes with no call open is sent GOAWAY).

    gRPC's "tarpit" is off: by default the core holds back its answer to a stream it refused (a
    message over the receive limit) for a random 0.1-1 s, while the client goes on sending the
    rest of the message. Answered at once, the client stops sending (the refusal costs the
    gateway less) and learns what to fix, as the HTTP surface's 413 does."""
    overrides = {"grpc.max_receive_message_length": serving.max_request_bytes, "grpc.http.tarpit": 0,
                 "grpc.max_connection_idle_ms": max(1, int(serving.grpc_idle_timeout_s * 1000)),
                 "grpc.server_handshake_timeout_ms": max(1, int(serving.http_header_timeout_s * 1000)),
                 "grpc.max_concurrent_streams": serving.grpc_max_concurrent_streams}
    if serving.max_connections:
        overrides["grpc.max_allowed_incoming_connections"] = serving.max_connections
    return _with(CHANNEL_OPTIONS, overrides)


def add_health_and_reflection(server: grpc.Server | grpc.aio.Server, service_names: Iterable[str],
                              aio: bool) -> health.HealthServicer | health.aio.HealthServicer:
    """Register grpc.health.v1 (every service SERVING) and server reflection."""
    servicer = health.aio.HealthServicer() if aio else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def set_serving(servicer: health.HealthServicer, service_names: Iterable[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        servicer.set(name, status)


async def set_serving_aio(servicer: health.aio.HealthServicer, service_names: Iterable[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


def error_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from our errors to (status code, details). Any other error is a bug, answered
    INTERNAL with `internal_error_message` (logged; the caller learns only the request id)."""
    if isinstance(error, HeteroError):
        return grpc_status_for(error), error.message
    return grpc.StatusCode.INTERNAL, internal_error_message(error)


def internal_error_message(error: BaseException, request_id: str | None = None) -> str:
    """Log an unexpected error (its type, text and traceback, with the request id structlog's context holds)
    and return what the client is told: only that it happened and the id to find it by in the log. An
    exception's text can hold file paths, addresses, configuration or another request's data.
    `request_id`: the id the client knows, when the caller has it (HTTP's X-Request-Id); else the context's."""
    bound = structlog.contextvars.get_contextvars().get("request_id")
    request_id = request_id or (str(bound) if bound else None)
    structlog.get_logger("hetero_common.errors").error(
        "internal error", error_type=type(error).__name__, error=str(error), exc_info=error,
        **({"request_id": request_id} if request_id else {}))
    where = f" (request id {request_id})" if request_id else ""
    return f"internal error{where}; the server log has the details"


def end_call(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End a grpc.aio call with `error`'s status without raising; the handler then returns.

    `context.abort` raises, and an exception leaving a grpc.aio handler stays, with the request
    message, in a reference cycle through grpc's own frames until the garbage collector's next
    full pass: a client sending refused 4 MiB prompts grew the gateway by 8 MiB a request. A
    status set and a plain return leave nothing behind (with a non-OK status grpc discards what a
    unary handler returns)."""
    set_status(context, *error_status(error))


def set_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """`end_call` for a status already known (a request that failed downstream)."""
    context.set_code(code)
    context.set_details(details)


# --- TLS: public ports with TLS, internal links with mutual TLS ---------------------------

def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSConfig, mutual: bool) -> grpc.ServerCredentials | None:
    """None when TLS is off. `mutual`: clients must present a certificate signed by tls.ca_file."""
    if not tls.enabled:
        return None
    pair = [(_read(tls.key_file), _read(tls.cert_file))]
    if mutual:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(tls.ca_file), require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(tls: TLSConfig, mutual: bool) -> grpc.ChannelCredentials | None:
    """What a client of a TLS server presents: the CA to trust (and, for mutual TLS, its own pair)."""
    if not tls.enabled:
        return None
    if mutual:
        return grpc.ssl_channel_credentials(_read(tls.ca_file), _read(tls.key_file), _read(tls.cert_file))
    # A public port: trust its CA when configured, else the certificate itself (self-signed).
    return grpc.ssl_channel_credentials(_read(tls.ca_file or tls.cert_file))


def bind(server: grpc.Server | grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def internal_listen_address(config: Config, address: str) -> str:
    """Where an internal service listens: its address, or internal_bind_host with the same port."""
    if config.internal_bind_host:
        return f"{config.internal_bind_host}:{address.rsplit(':', 1)[1]}"
    return address


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else, a wildcard (0.0.0.0, ::, an empty host), a LAN
    address or another name (not resolved: what it names can change), is not."""
    host = host.strip().strip("[]").split("%", 1)[0].lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_internal_bind(config: Config, listen_address: str, service_name: str) -> None:
    """Refuse (SystemExit) to listen on a non-loopback `listen_address` in plaintext: without
    `internal_tls` any caller reaching the port could submit work, read stats or drive the worker.
    `allow_insecure_internal` lets it (with a warning), for a trusted network. A Unix socket is
    local. Only gRPC: tensor-parallel ranks' torch.distributed rendezvous is not checked here."""
    if config.internal_tls.enabled or listen_address.startswith(("unix:", "unix-abstract:")):
        return
    host = listen_address.rsplit(":", 1)[0] if ":" in listen_address else listen_address
    if is_loopback_host(host):
        return
    if config.allow_insecure_internal:
        structlog.get_logger(service_name).warning(
            "listening in plaintext on a non-loopback address (allow_insecure_internal): any caller that reaches "
            "the port may call this service", address=listen_address)
        return
    raise SystemExit(f"{service_name}: refusing to listen on {listen_address} in plaintext: set internal_tls.cert_file, "
                     "key_file and ca_file (mutual TLS; `hetero-infer internal-certs` makes them), or "
                     "allow_insecure_internal: true on a trusted network")


def internal_channel(config: Config, address: str, server_name: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to an internal service (scheduler, worker), with mutual TLS when configured.
    `server_name`: the name the peer's certificate must carry when it is not `address`'s host (a
    replica found through worker_dns is dialled by its IP, but its certificate names the DNS name)."""
    creds = channel_credentials(config.internal_tls, mutual=True)
    options = internal_channel_options(config)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(address, creds, options=options)


async def termination_signal() -> None:
    """Return on SIGTERM or SIGINT: a service drains and stops then, instead of dying mid-request."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
