"""One JSON answer sent straight on a raw ASGI `send`, for the layers that answer before any app
runs (the connection cap, the request id, the API key, the body limit): its status, body and the
headers that layer adds."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_json(send: Send, status: int, payload: dict[str, Any],
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
