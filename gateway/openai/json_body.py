"""JSON request bodies counted before they are parsed, so that no body holds the event loop long.

json.loads is C and holds the GIL until it is done: a body of up to `serving.max_request_bytes`
made of many small values (200k `logit_bias` entries, a list of a million numbers) took it 0.1 s
on an idle core and 0.4 s on a busy one, during which every other client of the gateway waited.
Parsing it on a thread does not help (the GIL is held all the same), and json's pure-Python
scanner, which yields the GIL, took over a second for such a body.

So a body is counted first, by its commas and opening brackets (a bound from above on its values;
3 ms for 4 MiB). When that count is over the cap, it is counted once more without its
strings (their commas and brackets are text, not values): escapes dropped (`bytes.replace`), then
each string's quotes found. A body of more strings than the cap (200k `logit_bias` keys) is
refused on that count alone; otherwise the strings are cut out and the rest counted. Both passes
are C loops over the bytes with few Python objects made: tens of milliseconds at most for 4 MiB,
where a regular expression that follows escapes took 50 ms on an idle core for 200k strings.
No request the gateway serves holds more than `max_model_len` token ids plus `OTHER_VALUES`
others (logit_bias is at most 1,024 entries, stop lists and tools are small), so a body counted
over that is refused with 413 before it is parsed. What is left parses in C in tens of
milliseconds at most; a long prompt is one string, whatever it holds.

json.loads also recurses once per nested object or array, so a body of `[[[[...` raised
RecursionError (a few hundred levels deep on a busy stack). A body nesting deeper than
`MAX_NESTING` is refused with 400 before it is parsed; its depth is measured without recursion
(`hetero_common.constraints.json_nesting`), only when it holds that many opening brackets at all.

FastAPI reads the body through `Request.json()`; `CountedJsonRoute` hands its routes a request whose
`json()` is this. The cap is read per request from `app.state.json_value_cap` (a callable: the
served `max_model_len` is known only once the backend answers)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable, Coroutine

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from hetero_common.constraints import MAX_SCHEMA_NESTING, json_nesting

OTHER_VALUES = 65536  # a request's values besides its prompt token ids, at most
# Objects and arrays a body may nest: a schema of constraints.MAX_SCHEMA_NESTING levels inside
# `response_format.json_schema.schema` or `tools[].function.parameters` with room to spare, so that
# a schema deeper than its own cap gets the 400 naming its field rather than this one.
MAX_NESTING = 2 * MAX_SCHEMA_NESTING
YIELD_BYTES = 2**18  # bodies this large are counted and parsed in steps, the loop running between them
UNESCAPED_STRING = re.compile(rb'"[^"]*"')  # a JSON string once its escapes are dropped


def counted_values(body: bytes) -> int:
    """Commas plus opening brackets: at least the number of values the body holds, less one.
    One pass that drops them (`bytes.translate`) takes half the time of three `count`s."""
    return len(body) - len(body.translate(None, b",[{"))


def values_outside_strings(body: bytes, cap: int) -> int:
    """The body's values counted without the commas and brackets inside its strings; once its
    strings alone are over `cap`, their number (each is a key or a value json.loads makes).

    Dropping every `\\\\` and then every `\\"` leaves exactly the quotes that open and close strings:
    `bytes.replace` pairs backslashes from the left, as JSON's escapes do. Outside strings a
    backslash is invalid JSON, and json.loads stops at it: what it would parse before is counted
    right."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = unescaped.count(b'"') // 2
    if strings > cap:
        return strings
    return max(strings, counted_values(UNESCAPED_STRING.sub(b'""', unescaped)))


async def parse(body: bytes, cap: int) -> Any:
    """The body's JSON, refused 413 when it holds more than `cap` values. Between the passes over
    a large body the event loop runs what is ready (the tokens of other clients' streams): each
    pass holds it a few milliseconds, where all of them in one go held it for 10-15."""
    large = len(body) >= YIELD_BYTES
    values = counted_values(body)
    if values > cap:  # strings may hold commas and brackets: count again without them (rare)
        if large:
            await asyncio.sleep(0)
        values = values_outside_strings(body, cap)
    if values > cap:
        raise HTTPException(413, f"the request body holds over {values} JSON values (counted by its strings, commas and "
                                 f"opening brackets); at most {cap} are accepted (max_model_len token ids plus "
                                 f"{OTHER_VALUES}): send fewer")
    if large:
        await asyncio.sleep(0)
    check_nesting(body)
    if large:
        await asyncio.sleep(0)
    try:
        return json.loads(body)
    except RecursionError:  # not after check_nesting, unless the stack is already deep: a 400 all the same
        raise HTTPException(400, "the request body nests objects and arrays too deeply to parse") from None


def check_nesting(body: bytes) -> None:
    """Refuse (400) a body whose objects and arrays nest deeper than MAX_NESTING. Only a body with more
    opening brackets than that can (one pass in C); only such a body is measured."""
    if len(body) - len(body.translate(None, b"[{")) <= MAX_NESTING:
        return
    depth = json_nesting(body)
    if depth > MAX_NESTING:
        raise HTTPException(400, f"the request body nests objects and arrays {depth} deep; at most {MAX_NESTING} "
                                 "levels are accepted")


class CountedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await parse(await self.body(), self.app.state.json_value_cap())
        return self._json


class CountedJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_counted_json(request: Request) -> Response:
            return await handler(CountedJsonRequest(request.scope, request.receive))

        return with_counted_json
