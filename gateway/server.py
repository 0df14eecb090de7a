"""The gateway process: builds the backend and the generation path, serves gRPC and (unless
serving.http_port is 0) the OpenAI-style HTTP API on one asyncio loop, and drains on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Any

import grpc
import structlog
import uvicorn

from gateway.auth import ApiKeyInterceptor, ApiKeys, check_exposure
from gateway.backends.backend import Backend
from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.backends.fallback import FallbackBackend
from gateway.backends.scheduler_backend import SchedulerBackend
from gateway.embedding import Embeddings
from gateway.generation import Generation
from gateway.grpc.grpc_api import SERVICE_NAME, InferenceServicer, add_inference_servicer
from gateway.limits.http_protocol import limited_protocol
from gateway.metrics_listener import MetricsOnlyApp
from gateway.openai.app import HttpApi, error_body
from hetero_common.config import Config
from hetero_common.errors import HeteroError, UnavailableError
from hetero_common.gc_tuning import tune_gc
from hetero_common.grpc_server import (
    add_health_and_reflection,
    bind,
    public_server_options,
    server_credentials,
    set_serving_aio,
    termination_signal,
)
from hetero_common.model_files import resolve_model_path
from hetero_common.tokenizer import TextTokenizer, load_tokenizer

log = structlog.get_logger("gateway.server")


def load_gateway_tokenizer(config: Config) -> TextTokenizer:
    """The configured tokenizer. With tokenizer.kind simple and the command bridge alone, no model is
    served, so none is checked (or needed); otherwise the simple tokenizer must match the model's vocabulary."""
    backend = config.serving.backend
    bridge_only = backend.kind == "command_bridge" and backend.fallback == "none"
    model = None if config.tokenizer.kind == "simple" and bridge_only else resolve_model_path(config.model)
    return load_tokenizer(model, config.tokenizer.path, kind=config.tokenizer.kind)


def served_model_path(config: Config) -> Path | None:
    """The served model's file or directory (its embedding pooling config), where the gateway can find it."""
    try:
        return resolve_model_path(config.model)
    except HeteroError:
        return None


def generation_backend(config: Config, tokenizer: TextTokenizer, scheduler: SchedulerBackend) -> Backend:
    """serving.backend: the scheduler, the command bridge, or the scheduler falling back to the bridge."""
    backend = config.serving.backend
    if "command_bridge" not in (backend.kind, backend.fallback):
        return scheduler
    bridge = CommandBridgeBackend(CommandBridge(backend), tokenizer, config.serving.model_name)  # config checked its program
    return bridge if backend.kind == "command_bridge" else FallbackBackend(scheduler, bridge)


async def serve_gateway(config: Config) -> None:
    """gRPC and the HTTP API, one generation path, until SIGTERM or SIGINT; then drain."""
    keys = ApiKeys.from_config(config)  # first: a keys file with no key, or no keys off loopback, stops start-up
    check_exposure(config, keys)
    tokenizer = load_gateway_tokenizer(config)
    scheduler = SchedulerBackend(config, tokenizer)  # also the source of /readyz and pool metrics
    generation = Generation(config, tokenizer, generation_backend(config, tokenizer, scheduler))
    server = grpc.aio.server(options=public_server_options(config.serving), interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [])
    embeddings = Embeddings(config.serving.embedding, generation, served_model_path(config))
    add_inference_servicer(InferenceServicer(generation, embeddings), server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=True)
    await set_serving_aio(health, [SERVICE_NAME], serving=False)  # grpc's default for "" is SERVING
    address = f"{config.serving.host}:{config.serving.port}"
    if bind(server, address, server_credentials(config.serving.tls, mutual=False)) == 0:
        raise SystemExit(f"gateway: cannot bind {address}; is another process using it?")
    await server.start()
    await generation.start()
    api = HttpApi(generation, keys, scheduler.stats, config.serving, embeddings)
    listeners = []  # the HTTP API, and `enable_metrics`' own /metrics
    if config.serving.http_port:
        listeners.append(await start_http_server(config, api.app, config.serving.http_port, "serving.http_port"))
    if config.enable_metrics:
        listeners.append(await start_http_server(config, MetricsOnlyApp(api), config.metrics_port, "metrics_port"))
    await set_serving_aio(health, [SERVICE_NAME])
    tune_gc()
    log.info("gateway serving", address=address, http_port=config.serving.http_port or None, model=config.serving.model_name,
             tls=config.serving.tls.enabled, api_keys=keys.enabled)
    await termination_signal()
    # Drain: report NOT_SERVING, refuse new calls, give in-flight ones drain_grace_s to finish. Both
    # protocols at once: one after the other took up to twice the grace, past the time `serve` (or, with
    # `serve` gone, the parent-death watchdog) allows a stopping service.
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    log.info("draining", grace_s=config.drain_grace_s)
    await asyncio.gather(server.stop(grace=config.drain_grace_s), *(http.stop(config.drain_grace_s) for http in listeners))
    generation.backend.stop()
    log.info("gateway stopped")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn on the gateway's own loop: the gateway owns SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class RunningHttpServer:
    def __init__(self, server: _EmbeddedServer, task: asyncio.Task[None]) -> None:
        self.server, self.task = server, task

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, give open requests `grace_s`, then close what is left (a timeout is no error:
        it must not keep the gRPC side from draining)."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(self.task, timeout=grace_s)


async def start_http_server(config: Config, app: Any, port: int, port_key: str) -> RunningHttpServer:
    """`app` (ASGI) served on serving.host:`port` (the config key `port_key`), with the serving TLS and limits."""
    tls = config.serving.tls
    # Bind here, so a taken port fails start-up with our message (uvicorn would sys.exit inside a task).
    host = config.serving.host
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        hint = " (0 disables HTTP)" if port_key == "serving.http_port" else ""
        raise SystemExit(f"gateway: cannot bind HTTP {host}:{port} ({exc}); set {port_key}{hint}")
    limits = config.serving  # the body cap and body timeout are the app's (openai/body_limit.py)
    protocol = limited_protocol(limits.http_header_timeout_s, limits.max_connections,
                                lambda cap: error_body(429, f"the gateway has {cap} connections open "
                                                            "(serving.max_connections); retry later"),
                                lambda message: error_body(400, message))
    server = _EmbeddedServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                            ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file,
                                            timeout_graceful_shutdown=5, http=protocol, ws="none",
                                            timeout_keep_alive=limits.http_keep_alive_timeout_s))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise UnavailableError("HTTP server stopped during start-up")
        await asyncio.sleep(0.01)
    log.info("http serving", address=f"{'https' if tls.enabled else 'http'}://{host}:{port}", port_key=port_key)
    return RunningHttpServer(server, task)
