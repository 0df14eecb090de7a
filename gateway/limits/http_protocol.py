"""uvicorn's h11 protocol with the limits uvicorn has no setting for: a header read timeout
(`serving.http_header_timeout_s`), a cap on open connections that answers 429, never 5xx
(`serving.max_connections`), and a lingering close.

- Header timeout: a request's line and headers must be complete within the timeout of the
  connection opening, or of the first byte of a request on a kept-alive connection; else the
  connection is closed. A client that trickles its headers, or opens a connection and sends
  nothing, holds it no longer than that. (Idle kept-alive connections are closed by uvicorn's
  `timeout_keep_alive`; body timeouts and the body cap are `openai/body_limit.py`'s.)
- Connections beyond the cap: uvicorn's own `limit_concurrency` answers 503, a 5xx. Here such a
  connection gets its first request answered 429 with `Retry-After` in OpenAI's error shape and
  is closed, and its header timeout is at most `OVER_CAP_HEADER_TIMEOUT_S`, so it cannot hold
  its place waiting.
- A request that is not HTTP/1.1 h11 can parse (a malformed request line, headers over h11's
  16 KiB) is answered 400 in OpenAI's error shape, as every other error, instead of uvicorn's
  plain-text one.
- Lingering close: when a response closes the connection while the client is still sending its
  body (a 413 or 408), closing at once would make the kernel reset the connection, and the
  client could lose the answer. Instead the write side is shut, the rest of the body is read and
  dropped, and the connection is closed when the client closes it, or after `LINGER_S` (nginx's
  `lingering_close`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.asgi_answer import send_json

log = structlog.get_logger("gateway.http")

OVER_CAP_HEADER_TIMEOUT_S = 1.0
LINGER_S = 5.0


class _LingeringTransport:
    """The protocol's transport; `close` lingers while the client is still sending a body."""

    def __init__(self, transport: asyncio.Transport, protocol: "LimitedH11Protocol") -> None:
        self._transport, self._protocol, self._lingering = transport, protocol, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self._lingering or self._transport.is_closing():
            return
        if self._protocol.conn.their_state is not h11.SEND_BODY:
            self._transport.close()
            return
        self.linger()

    def linger(self) -> None:
        """Shut the write side once the answer is out, read and drop what the client still sends,
        and close when it closes or after LINGER_S."""
        if self._lingering or self._transport.is_closing():
            return
        self._lingering = True
        self._protocol.lingering = True
        self._transport.resume_reading()
        if self._transport.can_write_eof():
            self._transport.write_eof()  # after what is buffered: the answer goes out whole
        asyncio.get_running_loop().call_later(LINGER_S, self._transport.close)


class LimitedH11Protocol(H11Protocol):
    """Set by `limited_protocol` (uvicorn builds one per connection)."""

    header_timeout_s: float = 10.0
    max_connections: int = 0  # 0 = no cap
    over_cap_body: Callable[[int], dict[str, Any]]
    bad_request_body: Callable[[str], dict[str, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lingering = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_limit_s = self.header_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        if self.max_connections and len(self.connections) > self.max_connections:
            self.app = self._too_many_connections
            self._header_limit_s = min(self.header_timeout_s, OVER_CAP_HEADER_TIMEOUT_S)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a refused body: dropped
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first byte of a request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the request's headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # a pipelined request's headers were already in

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self._header_limit_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("http header timeout: connection closed", client=self.client, timeout_s=self._header_limit_s)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:  # uvicorn's, when h11 cannot parse the request
        body = json.dumps(self.bad_request_body(
            "the request is not HTTP/1.1 that the gateway can parse (a malformed request line or header, or a request "
            "line and headers over 16 KiB); send a well-formed request with smaller headers")).encode()
        for event in (h11.Response(status_code=400, headers=[(b"content-type", b"application/json"),
                                                             (b"content-length", str(len(body)).encode()),
                                                             (b"connection", b"close")]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # The client may still be sending (headers of a megabyte): closing now would reset the
        # connection under it and lose this answer, so linger as for a refused body.
        self.transport.linger()  # type: ignore[attr-defined]

    async def _too_many_connections(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send_json(send, 429, self.over_cap_body(self.max_connections),
                        ((b"retry-after", b"1"), (b"connection", b"close")))


def limited_protocol(header_timeout_s: float, max_connections: int, over_cap_body: Callable[[int], dict[str, Any]],
                     bad_request_body: Callable[[str], dict[str, Any]]) -> type[LimitedH11Protocol]:
    """The protocol class uvicorn is given (`uvicorn.Config(http=...)`), with the gateway's limits
    and its error bodies (a 429 over the connection cap, a 400 for what h11 cannot parse)."""
    return type("GatewayH11Protocol", (LimitedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections,
        "over_cap_body": staticmethod(over_cap_body), "bad_request_body": staticmethod(bad_request_body)})
