"""JSON request bodies parsed without holding the gateway's event loop.

json.loads is C and holds the GIL until it is done: a body of up to `serving.max_request_bytes`
made of many small values (200k `logit_bias` entries, a list of a million numbers) took it 0.1 s
on an idle core and 0.4 s on a busy one, during which every other client of the gateway waited.
A body with few values (a long prompt is one string) parses in milliseconds and is parsed on the
loop. One that may hold more than `OFF_LOOP_VALUES` values (counted from above by its commas and
opening brackets, which costs a millisecond for 4 MiB) is parsed on a thread by json's pure-Python
scanner, which yields the GIL to the loop every switch interval (5 ms): that request waits longer
(0.4 s for the 200k entries), the others do not. The result, and the errors (JSONDecodeError,
RecursionError for deep nesting), are json.loads's.

FastAPI reads the body through `Request.json()`; `OffLoopJsonRoute` hands its routes a request
whose `json()` is this."""

from __future__ import annotations

import asyncio
import json
import json.scanner
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

OFF_LOOP_VALUES = 16384  # json.loads takes about 3 ms for this many values


def might_hold_many_values(body: bytes) -> bool:
    return body.count(b",") + body.count(b"[") + body.count(b"{") > OFF_LOOP_VALUES


def loads_yielding(body: bytes) -> Any:
    """json.loads(body), by the pure-Python scanner (strings are still scanned in C)."""
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(body.decode(json.detect_encoding(body), "surrogatepass"))  # as json.loads decodes bytes


async def parse(body: bytes) -> Any:
    if not might_hold_many_values(body):
        return json.loads(body)
    return await asyncio.to_thread(loads_yielding, body)


class OffLoopJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await parse(await self.body())
        return self._json


class OffLoopJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_off_loop_json(request: Request) -> Response:
            return await handler(OffLoopJsonRequest(request.scope, request.receive))

        return with_off_loop_json
