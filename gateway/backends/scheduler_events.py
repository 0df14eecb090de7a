"""The gateway's Follow stream: the scheduler's token events for every request of this gateway,
one message per engine step, routed to each request's queue.

A request still has its own Submit call, which lives as long as the request does: cancelling it
aborts the request, its deadline is the request's, and it ends with the request's error status.
Only the events travel on the shared stream (SubmitRequest.follower_id): at batch 64 one gRPC
message per token per request was most of the scheduler's and the gateway's CPU.

A queue receives TokenEvents, then the error that broke the stream (when it breaks); a Submit
call that ends puts `SubmitEnded` with its error or None (see scheduler_backend.py).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import grpc
import structlog

from hetero.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.finish_reasons import is_finished

log = structlog.get_logger("gateway.backends.scheduler_events")


@dataclass(frozen=True)
class SubmitEnded:
    """The request's Submit call ended: OK (`error` None) or with an error status."""

    error: BaseException | None


def stream_closed_error() -> grpc.aio.AioRpcError:
    """The Follow stream ended without an error (the scheduler is draining): UNAVAILABLE, as a
    broken connection would be, so that a request with no event yet is retried."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the scheduler closed the token event stream")


class FollowCall:
    """One Follow call and the queues of the requests whose events it carries."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.follower_id = uuid.uuid4().hex
        self.queues: dict[str, list[asyncio.Queue[object]]] = {}
        self.broken = False
        self._call = stub.Follow(scheduler_pb2.FollowRequest(follower_id=self.follower_id))
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error: BaseException
        try:
            async for batch in self._call:
                queues = self.queues
                for event in batch.events:
                    for queue in queues.get(event.request_id, ()):
                        queue.put_nowait(event)
            error = stream_closed_error()
        except grpc.aio.AioRpcError as exc:
            error = exc
        self.broken = True
        if self.queues:
            log.warning("token event stream ended", error=str(getattr(error, "details", lambda: error)()),
                        requests=len(self.queues))
        for queues in self.queues.values():
            for queue in queues:
                queue.put_nowait(error)


class FollowStreams:
    """Opens the Follow stream on the first request, and a new one after it breaks."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._current: FollowCall | None = None

    def subscribe(self, request_id: str) -> tuple[FollowCall, asyncio.Queue[object]]:
        """A queue of `request_id`'s events, on the stream whose follower id its Submit must name."""
        if self._current is None or self._current.broken:
            self._current = FollowCall(self._stub)
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._current.queues.setdefault(request_id, []).append(queue)
        return self._current, queue

    @staticmethod
    def unsubscribe(call: FollowCall, request_id: str, queue: asyncio.Queue[object]) -> None:
        queues = call.queues.get(request_id)
        if queues is not None and queue in queues:
            queues.remove(queue)
            if not queues:
                del call.queues[request_id]


def can_merge(event: scheduler_pb2.TokenEvent, later: scheduler_pb2.TokenEvent) -> bool:
    """Whether `later` (the next event of the same request) may be sent as part of `event`: the same
    sample, `event` not its last, `later` carrying nothing that only a sample's first event has, and not
    an error (which ends the stream: the tokens before it go out first)."""
    return (later.index == event.index and not is_finished(event.finish_reason) and not later.prompt_logprobs
            and not later.cached_prompt_tokens and not later.queue_seconds
            and later.finish_reason != common_pb2.FINISH_REASON_ERROR)


def merge_events(event: scheduler_pb2.TokenEvent, later: scheduler_pb2.TokenEvent,
                 owned: bool = False) -> scheduler_pb2.TokenEvent:
    """One event holding `event`'s tokens then `later`'s, with `later`'s position, finish reason and error.
    `owned`: `event` is a merge result already (not part of a Follow batch message): extended in place."""
    if owned:
        merged = event
    else:
        merged = scheduler_pb2.TokenEvent()
        merged.CopyFrom(event)  # the events belong to a Follow batch message: left as they are
    merged.token_ids.extend(later.token_ids)
    merged.token_timestamps.extend(later.token_timestamps)
    merged.logprobs.extend(later.logprobs)
    merged.top_logprobs.extend(later.top_logprobs)
    merged.draft_tokens += later.draft_tokens
    merged.accepted_draft_tokens += later.accepted_draft_tokens
    merged.position = later.position
    merged.finish_reason = later.finish_reason
    merged.error = later.error
    return merged
