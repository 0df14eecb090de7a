"""Who is calling the gateway: API keys, their roles, and the tenant each key is.

`authorization: Bearer KEY` in gRPC metadata or HTTP headers. Keys come from `serving.api_keys`
and `serving.api_keys_file`; admin keys from `serving.admin_api_keys` and its `_file` (one per
line, `#` comments; a file holding no key stops start-up: a mis-mounted Secret must not turn
authentication off). Only SHA-256 digests are kept and compared in constant time; a key is
never logged: logs, metrics and request ids name its tenant by `tenancy.key_label`.

A call's caller is its `Principal`, set for the call's task by the gRPC interceptor and the HTTP
middleware (`http_auth.py`) and read with `current_principal()`. With no keys configured there
is one caller, `UNAUTHENTICATED`, which may do everything (the gateway then serves only on a
loopback address unless `serving.allow_unauthenticated`: `check_exposure`). Health checks and
server reflection stay open (load balancers and grpcurl discovery need them).
"""

from __future__ import annotations

import hashlib
import hmac
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from hetero_common.config import Config
from hetero_common.errors import AuthenticationError, ConfigError, PermissionDeniedError
from hetero_common.grpc_server import end_call, is_loopback_host
from hetero_common.tenancy import key_label

# gRPC methods that never need a key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Principal:
    """A caller: its tenant (the key's label; "" with no keys configured) and whether it is an admin."""

    tenant: str
    admin: bool


UNAUTHENTICATED = Principal(tenant="", admin=True)
_CURRENT: ContextVar[Principal] = ContextVar("hetero_principal", default=UNAUTHENTICATED)


def current_principal() -> Principal:
    return _CURRENT.get()


def require_admin(action: str) -> None:
    """Raise PermissionDeniedError naming the role unless the current caller is an admin."""
    principal = current_principal()
    if not principal.admin:
        raise PermissionDeniedError(f"{action} needs an admin key (serving.admin_api_keys); the key sent "
                                    f"({principal.tenant}) is an inference key")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str, key_name: str) -> list[str]:
    """The keys in a keys file; none at all is a ConfigError naming the file."""
    lines = Path(path).read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"config key '{key_name}' = {path!r} holds no key (empty, or only comments): is the "
                          "Secret mounted? Refusing to start with authentication silently off")
    return keys


class ApiKeys:
    def __init__(self, keys: list[str], admin_keys: list[str] = ()) -> None:  # type: ignore[assignment]
        self._principals: list[tuple[bytes, Principal]] = []
        for key, admin in [*((k, False) for k in keys if k), *((k, True) for k in admin_keys if k)]:
            self._principals.append((_digest(key), Principal(key_label(key), admin)))

    @classmethod
    def from_config(cls, config: Config) -> "ApiKeys":
        serving = config.serving
        keys, admin_keys = list(serving.api_keys), list(serving.admin_api_keys)
        if serving.api_keys_file:
            keys += read_keys_file(serving.api_keys_file, "serving.api_keys_file")
        if serving.admin_api_keys_file:
            admin_keys += read_keys_file(serving.admin_api_keys_file, "serving.admin_api_keys_file")
        return cls(keys, admin_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._principals)

    def check(self, authorization: str | None) -> Principal:
        """The caller `authorization` (`Bearer <a configured key>`) names; AuthenticationError otherwise."""
        if not self.enabled:
            return UNAUTHENTICATED
        if not authorization:
            raise AuthenticationError("missing API key: send the header `authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("malformed authorization header: expected `Bearer <key>`")
        given = _digest(key.strip())
        # Compare against every key (no early exit) so timing says nothing about which matched.
        found: Principal | None = None
        for digest, principal in self._principals:
            if hmac.compare_digest(given, digest):
                found = principal if found is None or principal.admin else found  # a key listed as both: admin
        if found is None:
            raise AuthenticationError("invalid API key")
        return found

    def enter(self, authorization: str | None) -> Principal:
        """`check`, and the caller set for the rest of this task (and the tasks it starts)."""
        principal = self.check(authorization)
        _CURRENT.set(principal)
        return principal


def check_exposure(config: Config, keys: ApiKeys) -> None:
    """Fail closed: with no keys, serve only on a loopback address unless allow_unauthenticated."""
    serving = config.serving
    if keys.enabled or serving.allow_unauthenticated or is_loopback_host(serving.host):
        return
    raise ConfigError(f"config key 'serving.host' = {serving.host!r} is not a loopback address and no API key is "
                      "configured: set serving.api_keys_file (or serving.api_keys), or serving.allow_unauthenticated: "
                      "true to serve everyone who reaches the port as an admin (trusted networks only)")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects hetero.v1 calls without a valid key with UNAUTHENTICATED (health and reflection stay
    open); a valid key's call runs with its Principal set."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            principal = self.keys.check(metadata.get("authorization"))
        except AuthenticationError as exc:
            return _denying_handler(handler, exc.message)
        return _as(handler, principal)


def _codec(handler: grpc.RpcMethodHandler) -> dict[str, Any]:
    return dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _as(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    """`handler`, run with `principal` as the caller. grpc.aio runs each call in its own task, so
    the context variable set here is that call's alone."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _CURRENT.set(principal)
            return await inner(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **_codec(handler))
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _CURRENT.set(principal)
            # aclosing: this stream closed (the client gone) closes the handler's at once, which ends the
            # request downstream, as without keys.
            async with aclosing(inner_stream(request, context)) as messages:
                async for message in messages:
                    yield message
        return grpc.unary_stream_rpc_method_handler(stream, **_codec(handler))
    return handler  # hetero.v1.Inference has no client-streaming calls


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    # The status set and no exception raised: an exception would keep the request (up to
    # serving.max_request_bytes) alive in a reference cycle of grpc's frames (grpc_server.end_call).
    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        end_call(context, AuthenticationError(message))

    async def deny_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        end_call(context, AuthenticationError(message))
        return
        yield  # pragma: no cover  (makes this an async generator, as streaming handlers are)

    codec = _codec(handler)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
