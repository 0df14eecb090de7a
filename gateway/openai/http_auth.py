"""The API-key check on the HTTP API, before anything of the request's body is read.

A pure ASGI middleware between the request-id middleware and the body limit: a request without
a valid key is answered 401 from its headers alone (a FastAPI dependency runs only after the
body has been read and parsed, so an unauthenticated client could make the gateway read and
parse up to serving.max_request_bytes). A valid key's caller (`auth.Principal`) is set for the
request's task, where the routes read it (`auth.current_principal`).

Open without a key: the probes (/healthz, /readyz), /openapi.json (API tools and fuzzers read
it), and /metrics unless serving.metrics_require_key.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from gateway.asgi_answer import send_json
from gateway.auth import ApiKeys
from hetero_common.errors import AuthenticationError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})


class ApiKeyMiddleware:
    def __init__(self, app: App, keys: ApiKeys, metrics_require_key: bool,
                 error_body: Callable[[int, str, str | None], dict[str, Any]]) -> None:
        self.app, self.keys, self.error_body = app, keys, error_body
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = [v for k, v in scope.get("headers", []) if k == b"authorization"]
        try:
            if len(authorization) > 1:
                raise AuthenticationError("send one authorization header")
            self.keys.enter(authorization[0].decode("latin-1") if authorization else None)
        except AuthenticationError as exc:
            await self._refuse(send, exc.message)
            return
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, message: str) -> None:
        await send_json(send, 401, self.error_body(401, message, None), ((b"www-authenticate", b"Bearer"),))
