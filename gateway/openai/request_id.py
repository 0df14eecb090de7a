"""`X-Request-Id` on the HTTP API: a client's own request id, validated, used as the request's id
(derived per prompt as `{id}-{prompt index}`), and echoed in the response header on every answer:
JSON, streams, errors. Without the header the gateway makes one (and echoes that).

A header the id cannot be (more than one, too long, or any character outside A-Z a-z 0-9 . _ : -,
control characters and NUL included) is refused with 400 naming `X-Request-Id`, not replaced: the
client's id is what it aborts by (gRPC `Abort`) and finds its request in the logs by, so an id
silently swapped for another would leave it looking for a request that never had its id. (vLLM
takes the header unchecked; a replaced id would also be echoed back in the answer's header, where a
client comparing it would only then find out.) The characters are fewer than gRPC's printable
ASCII (gateway/validation.py) because the id is echoed in a response header.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would wrap `receive` and hide
the client's disconnect from `streams.unless_client_gone`)."""

from __future__ import annotations

import re
import uuid
from typing import Any, Awaitable, Callable

from gateway.asgi_answer import send_json

HEADER = "X-Request-Id"
MAX_LEN = 100  # the per-prompt suffix keeps derived ids under validation.MAX_REQUEST_ID_LEN (128)
PATTERN = r"^[A-Za-z0-9._:-]{1,100}$"
_VALID = re.compile(PATTERN)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPENAPI_PARAMETER = {
    "name": HEADER, "in": "header", "required": False,
    "description": "your id for this request (echoed in the response header); one is made when absent",
    "schema": {"type": "string", "pattern": PATTERN, "maxLength": MAX_LEN},
}


def request_id(scope: Scope) -> str:
    """The id the middleware chose for this request."""
    return scope["state"]["request_id"]


class RequestIdMiddleware:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 error_body: Callable[[int, str, str | None], dict[str, Any]]) -> None:
        self.app = app
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope.get("headers", []) if k.lower() == HEADER.lower().encode()]
        rid = uuid.uuid4().hex[:16]
        problem = None
        if len(given) > 1:
            problem = f"send one {HEADER} header (got {len(given)})"
        elif given:
            text = given[0].decode("latin-1")
            if _VALID.fullmatch(text):  # not `match`: its `$` also matches before a final newline
                rid = text
            else:
                problem = f"{HEADER} must be 1-{MAX_LEN} characters of A-Z a-z 0-9 . _ : - (got {text[:40]!r})"
        scope.setdefault("state", {})["request_id"] = rid
        echo = (HEADER.lower().encode(), rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), echo]}
            await send(message)

        if problem is not None:
            await send_json(send_with_id, 400, self.error_body(400, problem, HEADER))
            return
        await self.app(scope, receive, send_with_id)
