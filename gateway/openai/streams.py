"""How the HTTP routes run generations: several requests' streams merged into one, and a plain
handler's work cancelled when its client goes away (both end the generations downstream)."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import aclosing
from typing import Any, AsyncIterator, Coroutine

import structlog
from fastapi import Request
from fastapi.responses import Response

from gateway.generation import Generation
from hetero.v1 import inference_pb2

log = structlog.get_logger("gateway.openai.streams")


async def merged(generation: Generation, requests: list[inference_pb2.GenerateRequest],
                 n: int, client_id: str) -> AsyncIterator[tuple[int, inference_pb2.GenerateResponse]]:
    """Run the prompts' requests (n samples each) concurrently; yield (choice index, response) as
    they come, choice index = request index * n + sample index. Errors propagate. The requests
    are registered under `client_id` (the HTTP request id, X-Request-Id, from which the requests'
    ids derive), which gRPC `Abort` takes."""
    queue: asyncio.Queue[tuple[int, inference_pb2.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: inference_pb2.GenerateRequest) -> None:
        try:
            async with aclosing(generation.generate(request, client_request_id=client_id)) as responses:
                async for response in responses:
                    await queue.put((index, response))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    scheduler_ids = [r.request_id for r in requests]
    generation.active.register(client_id, scheduler_ids)
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index * n + item.index, item
    finally:  # a client that goes away (or an error) cancels every request, aborting them downstream
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        generation.active.unregister(client_id, scheduler_ids)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read: what `receive` yields next is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_gone(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run a non-streaming handler's work, cancelled if its client goes away first: Starlette
    lets a plain handler run on after a disconnect, which would leave the generation running
    downstream (streamed answers are cancelled by Starlette itself)."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if answer.done():
        return answer.result()
    answer.cancel()  # unwinds `merged`, which cancels the requests and so aborts them downstream
    with contextlib.suppress(asyncio.CancelledError):
        await answer
    log.info("client disconnected; request aborted", path=request.url.path)
    return Response(status_code=499)  # nobody reads it; the status names what happened in access logs
