"""The HTTP API's request body limits: `serving.max_request_bytes` and `serving.http_body_timeout_s`.

A pure ASGI middleware in front of the routes. A `Content-Length` over the cap is answered 413
before any of the body is read; a chunked (or lying) body is read only until it passes the cap,
then 413. A body that has not all arrived within the timeout of its headers is answered 408. All
three close the connection (`connection: close`; the HTTP protocol, `http_protocol.py`, discards
the rest of the body the client is still sending rather than resetting the connection under it).

A body within the limits is read here whole (it is at most the cap) and handed to the routes as
one message; after it, `receive` is the server's own, so a route still sees the client leave
(`streams.unless_client_gone`)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from gateway.asgi_answer import send_json
from hetero_common.errors import HeteroError, RequestTimeoutError, RequestTooLargeError, http_status_for

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def too_large(max_bytes: int, size: str) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is {size} bytes; at most {max_bytes} are accepted "
                                "(serving.max_request_bytes): send a shorter prompt")


class BodyLimitMiddleware:
    def __init__(self, app: App, max_bytes: int, body_timeout_s: float,
                 error_body: Callable[[int, str, str | None], dict[str, Any]],
                 after_body: Callable[[int], None] = lambda size: None) -> None:
        """`after_body(size)`: called once a body has been answered (the heap trim after a large one)."""
        self.app, self.max_bytes, self.body_timeout_s, self.error_body = app, max_bytes, body_timeout_s, error_body
        self.after_body = after_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        if declared and declared[0].strip().isdigit() and int(declared[0]) > self.max_bytes:
            await self._refuse(send, too_large(self.max_bytes, declared[0].decode().strip()))
            return
        try:
            first = await self._read_body(receive)
        except HeteroError as exc:
            await self._refuse(send, exc)
            return
        if first is None:  # the client left before its body arrived: nobody to answer
            return
        size = len(first["body"])
        pending: list[Message] = [first]
        del first

        async def replay() -> Message:
            if pending:
                return pending.pop()  # handed over once: the body is not kept here after the route took it
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            self.after_body(size)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one `http.request` message; None when the client disconnected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):  # no task per read, unlike wait_for
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request body did not arrive within {self.body_timeout_s:g} s of its headers "
                    f"(serving.http_body_timeout_s; {size} bytes came)") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large(self.max_bytes, f"over {self.max_bytes}")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                return {"type": "http.request", "body": body, "more_body": False}

    async def _refuse(self, send: Send, exc: HeteroError) -> None:
        status = http_status_for(exc)
        await send_json(send, status, self.error_body(status, exc.message, None), ((b"connection", b"close"),))
