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

from gateway.auth import current_principal
from gateway.generation import Generation
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.tenancy import scoped_id

log = structlog.get_logger("gateway.openai.streams")
# Prompts of one HTTP request generating at once (a sliding window: the next starts when one ends). A
# completion of serving.max_prompts_per_request prompts, each of n samples, then takes at most this many
# of the scheduler's max_queued_requests and of the gateway's max_concurrent_requests, not all of them
# for everyone else, while 16 prompts of n samples still fill an engine's batch.
PROMPTS_IN_FLIGHT = 16


def _aborted_unstarted(request: inference_pb2.GenerateRequest,
                       model: str) -> list[inference_pb2.GenerateResponse]:
    """What a prompt still waiting for the window answers once an Abort named its request: each sample
    ends FINISH_REASON_ABORT, the last with the (empty) usage, as a generation aborted in flight ends;
    nothing was submitted, so nothing is counted."""
    n = max(1, request.params.n)
    answers = [inference_pb2.GenerateResponse(request_id=request.request_id, model=request.model or model, index=j,
                                              finish_reason=common_pb2.FINISH_REASON_ABORT) for j in range(n)]
    answers[-1].usage.CopyFrom(common_pb2.Usage())
    return answers


async def merged(generation: Generation, requests: list[inference_pb2.GenerateRequest],
                 n: int, client_id: str, window: int = PROMPTS_IN_FLIGHT,
                 ) -> AsyncIterator[tuple[int, inference_pb2.GenerateResponse]]:
    """Run the prompts' requests (n samples each), `window` at a time in prompt order; yield (choice
    index, response) as they come, choice index = request index * n + sample index. Errors propagate.
    The requests are registered under `client_id` (the HTTP request id, X-Request-Id, from which the
    requests' ids derive), which gRPC `Abort` takes; a prompt it aborts before its turn is never started."""
    tenant = current_principal().tenant  # the ids live in the caller's namespace (hetero_common/tenancy.py)
    queue: asyncio.Queue[tuple[int, inference_pb2.GenerateResponse | BaseException | None]] = asyncio.Queue()
    turns = asyncio.Semaphore(window)  # FIFO: prompts start in their order, as the tasks are made

    async def pump(index: int, request: inference_pb2.GenerateRequest) -> None:
        try:
            async with turns:
                if scoped_id(tenant, request.request_id) in generation.active.aborted:
                    for response in _aborted_unstarted(request, generation.model_name):
                        await queue.put((index, response))
                else:
                    async with aclosing(generation.generate(request, client_request_id=client_id)) as responses:
                        async for response in responses:
                            await queue.put((index, response))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    scheduler_ids = [scoped_id(tenant, r.request_id) for r in requests]
    scoped_client = scoped_id(tenant, client_id)
    generation.active.register(scoped_client, scheduler_ids)
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
        generation.active.unregister(scoped_client, scheduler_ids)


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
