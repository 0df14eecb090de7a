"""Optional API keys on the gateway: `authorization: Bearer KEY` in gRPC metadata or HTTP headers.

Keys come from `serving.api_keys` and `serving.api_keys_file` (one per line, `#` comments).
Only SHA-256 digests are kept in memory and compared in constant time; a key is never
logged. Health checks and server reflection stay open (load balancers and grpcurl discovery
need them); everything under hetero.v1.Inference needs a key when any is configured.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from hetero_common.config import Config
from hetero_common.errors import AuthenticationError
from hetero_common.grpc_server import end_call

# gRPC methods that never need a key.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(k) for k in keys if k]

    @classmethod
    def from_config(cls, config: Config) -> "ApiKeys":
        keys = list(config.serving.api_keys)
        if config.serving.api_keys_file:
            lines = Path(config.serving.api_keys_file).read_text().splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """Raise AuthenticationError unless `authorization` is `Bearer <a configured key>`."""
        if not self.enabled:
            return
        if not authorization:
            raise AuthenticationError("missing API key: send the header `authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("malformed authorization header: expected `Bearer <key>`")
        given = _digest(key.strip())
        # Compare against every key (no early exit) so timing says nothing about which matched.
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(given, digest)
        if not ok:
            raise AuthenticationError("invalid API key")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects hetero.v1 calls without a valid key with UNAUTHENTICATED (health and reflection stay open)."""

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
            self.keys.check(metadata.get("authorization"))
        except AuthenticationError as exc:
            return _denying_handler(handler, exc.message)
        return handler


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

    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
