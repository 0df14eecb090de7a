"""What every gRPC server of the stack gets: health service, reflection, error mapping."""

from __future__ import annotations

from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hetero_infer.errors import HeteroError, grpc_status_for

# Large enough for a step plan with thousands of prompt tokens; protobuf's own limit is 2 GiB.
MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


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
    """The one mapping from our errors to (status code, details)."""
    if isinstance(error, HeteroError):
        return grpc_status_for(error), error.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
