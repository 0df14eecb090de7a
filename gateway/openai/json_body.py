"""JSON request bodies counted before they are parsed, so that no body holds the event loop long.

json.loads is C and holds the GIL until it is done: a body of up to `serving.max_request_bytes`
made of many small values (200k `logit_bias` entries, a list of a million numbers) took it 0.1 s
on an idle core and 0.4 s on a busy one, during which every other client of the gateway waited.
Parsing it on a thread does not help (the GIL is held all the same), and json's pure-Python
scanner, which yields the GIL, took over a second for such a body.

So a body is counted first, by its commas and opening brackets (a bound from above on its values;
a millisecond for 4 MiB), and, when that count is over the cap, once more with its strings taken
out (their commas and brackets are text, not values). No request the gateway serves holds more than `max_model_len` token ids
plus `OTHER_VALUES` others (logit_bias is at most 1,024 entries, stop lists and tools are small),
so a body counted over that is refused with 413 before it is parsed. What is left parses in C in
tens of milliseconds at most; a long prompt is one string, whatever it holds.

FastAPI reads the body through `Request.json()`; `CountedJsonRoute` hands its routes a request whose
`json()` is this. The cap is read per request from `app.state.json_value_cap` (a callable: the
served `max_model_len` is known only once the backend answers)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Coroutine

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

OTHER_VALUES = 65536  # a request's values besides its prompt token ids, at most
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, its escapes included


def counted_values(body: bytes) -> int:
    """Commas plus opening brackets: at least the number of values the body holds, less one."""
    return body.count(b",") + body.count(b"[") + body.count(b"{")


def parse(body: bytes, cap: int) -> Any:
    values = counted_values(body)
    if values > cap:  # strings may hold commas and brackets: count again without them (tens of ms, rare)
        values = counted_values(JSON_STRING.sub(b'""', body))
    if values > cap:
        raise HTTPException(413, f"the request body holds up to {values} JSON values (commas and opening brackets); "
                                 f"at most {cap} are accepted (max_model_len token ids plus {OTHER_VALUES}): send fewer")
    return json.loads(body)


class CountedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse(await self.body(), self.app.state.json_value_cap())
        return self._json


class CountedJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_counted_json(request: Request) -> Response:
            return await handler(CountedJsonRequest(request.scope, request.receive))

        return with_counted_json
