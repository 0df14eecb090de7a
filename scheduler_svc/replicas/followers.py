"""Follow streams: the token events of one gateway's requests, one message per engine step.

A Submit that names a follower id (SubmitRequest.follower_id) hands its events to that
follower instead of writing them on its own stream: one gRPC message per token per request
cost the scheduler and the gateway most of their CPU at batch 64. The Submit call still lives
as long as its request, so cancellation (abort), deadlines, error statuses and re-attach keep
their meaning; only the way the events travel changes.
"""

from __future__ import annotations

import asyncio

from hetero.v1 import scheduler_pb2
from hetero_common.finish_reasons import is_finished
from scheduler_svc.request_streams import RequestStream


class Follower:
    """The events waiting to go out on one Follow stream."""

    def __init__(self, follower_id: str) -> None:
        self.follower_id = follower_id
        self.pending: list[scheduler_pb2.TokenEvent] = []
        self.followed = False  # a Follow call is reading
        self.submits = 0  # Submit calls sending their events here
        self.closed = False
        self._ready = asyncio.Event()

    def push(self, event: scheduler_pb2.TokenEvent) -> None:
        self.pending.append(event)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def next_batch(self) -> list[scheduler_pb2.TokenEvent] | None:
        """Every event pushed since the last batch (waits for one); None once closed. A step's
        events are all pushed in one go (RequestStreams.dispatch), so a batch is a step."""
        while not self.pending:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        batch, self.pending = self.pending, []
        return batch


class Forwarder:
    """A Submit call's listener (RequestStream.attach_listener) that sends the events on a Follow
    stream. The call learns only that its request ended (`done`) and with which event (`last`)."""

    def __init__(self, stream: RequestStream, follower: Follower) -> None:
        self.stream = stream
        self.follower = follower
        self.open_samples = stream.samples_to_follow()
        self.done = asyncio.Event()
        self.last: scheduler_pb2.TokenEvent | None = None

    def put_nowait(self, event: scheduler_pb2.TokenEvent) -> None:
        if event.finish_reason and is_finished(event.finish_reason):
            self.open_samples.discard(event.index)
            if not self.open_samples:
                self.last = event
                self.done.set()
                if self.stream.status is not None:
                    return  # the Submit call ends with that status instead, as on its own stream
        self.follower.push(event)


class Followers:
    """The followers by id: made by whichever comes first, the Follow call or a Submit naming it
    (the gateway sends both at once), dropped once neither uses it."""

    def __init__(self) -> None:
        self._by_id: dict[str, Follower] = {}

    def get(self, follower_id: str) -> Follower:
        follower = self._by_id.get(follower_id)
        if follower is None:
            follower = self._by_id[follower_id] = Follower(follower_id)
        return follower

    def release(self, follower: Follower) -> None:
        if not follower.followed and not follower.submits and self._by_id.get(follower.follower_id) is follower:
            del self._by_id[follower.follower_id]

    def close_all(self) -> None:
        for follower in self._by_id.values():
            follower.close()
