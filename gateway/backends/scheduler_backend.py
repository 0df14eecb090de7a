"""The scheduler backend: token ids from `hetero.v1.Scheduler`, turned into text here.

A request is one Submit call, whose token events come on this gateway's Follow stream (one
message per engine step for all requests: scheduler_events.py); each sample has its own
detokenizer and stop-string state (`TextStream`), so the text never breaks a UTF-8 character.
When the client cancels or disconnects, the Submit call is cancelled, which aborts the request
in the scheduler and frees its blocks.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, NoReturn

import grpc
import structlog

from gateway.backends.backend import EmbeddingCall, EmbeddingOutput, SampleOutput
from gateway.backends.scheduler_events import FollowCall, FollowStreams, SubmitEnded, can_merge, merge_events
from gateway.text.prompt_logprobs import (
    add_prompt_logprobs,
    add_token_logprobs,
    drop_generated,
    engine_params,
    scoring_only,
)
from gateway.text.text_stream import TextStream
from gateway.validation import PreparedRequest
from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2, scheduler_pb2_grpc
from hetero_common.config import Config
from hetero_common.embedding_vectors import EMBEDDING_PARAMS
from hetero_common.errors import (
    DeadlineExceededError,
    ExecutionError,
    HeteroError,
    LoraAdapterExistsError,
    LoraSlotsFullError,
    ModelNotFoundError,
    RequestAbortedError,
    UnavailableError,
    from_grpc_error,
)
from hetero_common.finish_reasons import is_finished
from hetero_common.grpc_server import internal_channel
from hetero_common.retry import retrying
from hetero_common.sampling import resolve
from hetero_common.tokenizer import TextTokenizer

log = structlog.get_logger("gateway.backends.scheduler_backend")
NAME = "scheduler"
# What the scheduler's LoRA management answers mean (scheduler_svc/lora/lora_manager.py).
_LORA_ERRORS = {grpc.StatusCode.ALREADY_EXISTS: LoraAdapterExistsError,
                grpc.StatusCode.FAILED_PRECONDITION: LoraSlotsFullError,
                grpc.StatusCode.NOT_FOUND: ModelNotFoundError}


class SchedulerBackend:
    def __init__(self, config: Config, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.serving.model_name
        self.channel = internal_channel(config, config.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.follows = FollowStreams(self.scheduler)

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        """The scheduler's pool and model figures (retried on UNAVAILABLE)."""
        try:
            async for attempt in retrying(self.config):
                with attempt:
                    return await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler") from exc
        raise AssertionError("unreachable")

    serves_lora = True

    def stop(self) -> None:
        pass  # what still runs is the scheduler's; a closed Submit call aborts its request there

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        try:
            async for attempt in retrying(self.config):
                with attempt:
                    answer = await self.scheduler.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), timeout=10)
                    return list(answer.adapters)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler") from exc
        raise AssertionError("unreachable")

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        try:  # not retried: a load that reached the scheduler and is retried would find its own name taken
            return await self.scheduler.LoadLoraAdapter(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler", _LORA_ERRORS) from exc

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        try:
            return await self.scheduler.UnloadLoraAdapter(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler", _LORA_ERRORS) from exc

    async def max_model_len(self) -> int | None:
        try:
            return (await self.stats()).max_model_len
        except HeteroError as exc:
            log.warning("scheduler not reachable at start; using config max_model_len", error=exc.message)
            return None

    async def model_facts(self) -> inference_pb2.ModelCard:
        try:
            stats = await self.stats()
        except HeteroError as exc:  # ListModels still answers, without them
            log.warning("scheduler not reachable; the model card has no architecture", error=exc.message)
            return inference_pb2.ModelCard()
        return inference_pb2.ModelCard(architecture=stats.architecture, num_experts=stats.num_experts,
                                       num_experts_per_tok=stats.num_experts_per_tok)

    async def server_info(self) -> inference_pb2.ServerInfo:
        stats = await self.stats()
        return inference_pb2.ServerInfo(pool=stats.pool, service=stats.service, backend=NAME,
                                        attention_backend=stats.attention_backend,
                                        device=stats.device)

    async def generate(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                       timeout: float | None) -> AsyncIterator[SampleOutput]:
        """A sample that matches a stop string is aborted downstream alone; the rest run on."""
        n = prepared.sampling.n
        streams = {i: TextStream(self.tokenizer, prepared.prompt_token_ids, prepared.sampling) for i in range(n)}
        scoring = scoring_only(request.params)  # max_tokens 0: the one token the engine samples is dropped
        # aclosing: returning early (every sample stopped) closes the generator at once, which
        # cancels the Submit call and so ends the request downstream.
        async with aclosing(self._events(prepared, engine_params(request.params), timeout, request.cache_salt,
                                         request.priority)) as events:
            async for event in events:
                stream = streams.get(event.index)
                if stream is None:
                    continue  # this sample already ended (stop string) before its abort landed
                response = self._response(prepared.request_id, event, stream, request.params, prepared.adapter)
                generated = len(response.token_ids)  # a stop string within a merged event: up to it
                if scoring:
                    drop_generated(response)
                    generated = 0
                if event.prompt_logprobs:
                    add_prompt_logprobs(response, event, prepared.prompt_token_ids, self._token_text)
                if is_finished(response.finish_reason):
                    del streams[event.index]
                    if n > 1 and response.stop_reason and streams:  # only this sample ends
                        await self._abort_sample(prepared.scoped_id, event.index)
                yield SampleOutput(response, generated, event.cached_prompt_tokens, event.queue_seconds,
                                   event.draft_tokens, event.accepted_draft_tokens)
                if not streams:
                    return

    async def embed(self, call: EmbeddingCall, timeout: float | None) -> EmbeddingOutput:
        """One Submit with `pooling` set: its one event carries the vector (or says why there is none)."""
        prepared = PreparedRequest(call.request_id, call.prompt_token_ids, resolve(EMBEDDING_PARAMS), call.adapter)
        async with aclosing(self._events(prepared, EMBEDDING_PARAMS, timeout, "", call.priority, call.pooling)) as events:
            async for event in events:
                if event.finish_reason == common_pb2.FINISH_REASON_STOP and event.embedding:
                    return EmbeddingOutput(event.embedding, event.queue_seconds)
                if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    raise RequestAbortedError(f"embedding request {call.request_id!r} was aborted")
                if event.finish_reason == common_pb2.FINISH_REASON_DEADLINE:
                    raise DeadlineExceededError(f"embedding request {call.request_id!r} passed its deadline")
                raise ExecutionError(event.error or f"embedding request {call.request_id!r} ended without its vector")
        raise ExecutionError(f"the scheduler ended embedding request {call.request_id!r} without an event")

    async def _events(self, prepared: PreparedRequest, params: common_pb2.SamplingParams,
                      timeout: float | None = None, cache_salt: str = "", priority: int = 0,
                      pooling: int = 0) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """The scheduler's token events, from this gateway's Follow stream (scheduler_events.py);
        the request's own Submit call ends with it. Failing to reach the scheduler (before the
        first event) is retried; the scheduler treats a repeated request id as the same request
        and replays its events so far, so a retry never starts a second generation. `timeout`
        (the client's remaining time) becomes the Submit deadline."""
        rid = prepared.scoped_id
        interval = self.config.serving.stream_interval
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        state = _EventState(set(range(prepared.sampling.n)))
        call: grpc.aio.UnaryStreamCall | None = None
        follow: FollowCall | None = None
        queue: asyncio.Queue[object] | None = None
        attempts = 0
        try:
            try:
                async for attempt in retrying(self.config):
                    with attempt:
                        if call is not None:
                            call.cancel()
                        if follow is not None and queue is not None:
                            self.follows.unsubscribe(follow, rid, queue)
                        attempts += 1
                        follow, queue = self.follows.subscribe(rid)
                        state.held = None  # from the queue of the attempt before
                        state.pending.clear()
                        submit = scheduler_pb2.SubmitRequest(
                            request_id=rid, prompt_token_ids=prepared.prompt_token_ids, params=params,
                            cache_salt=cache_salt, priority=priority, follower_id=follow.follower_id,
                            lora_adapter=prepared.adapter, pooling=pooling)
                        call = self.scheduler.Submit(
                            submit, timeout=None if deadline is None else max(0.001, deadline - loop.time()))
                        _report_end(call, queue)
                        event = await _next_event(queue, state, interval)
                while True:
                    yield event
                    if not state.open_samples:
                        return
                    event = await _next_event(queue, state, interval)  # type: ignore[arg-type]
            except grpc.aio.AioRpcError as exc:
                error = from_grpc_error(exc, "scheduler")
                if isinstance(error, UnavailableError):
                    error = UnavailableError(f"{error.message} (after {attempts} attempt(s); max_retry_attempts is "
                                             f"{self.config.max_retry_attempts})")
                raise error from exc
        finally:
            if call is not None:
                call.cancel()  # no-op when finished; aborts the request downstream otherwise
            if follow is not None and queue is not None:
                self.follows.unsubscribe(follow, rid, queue)

    async def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        """The scheduler's Abort: the request's Submit stream ends with FINISH_REASON_ABORT, its blocks freed."""
        try:
            answer = await self.scheduler.Abort(scheduler_pb2.AbortRequest(
                request_id=request_id, reason=common_pb2.FINISH_REASON_ABORT, any_tenant=any_tenant), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler") from exc
        return answer.found

    async def _abort_sample(self, request_id: str, index: int) -> None:
        try:
            await self.scheduler.Abort(scheduler_pb2.AbortRequest(
                request_id=request_id, reason=common_pb2.FINISH_REASON_STOP, index=index), timeout=10)
        except grpc.aio.AioRpcError as exc:  # the sample runs on to its max_tokens; its tokens are dropped here
            log.warning("could not abort a stopped sample", index=index, error=exc.details())

    def _response(self, request_id: str, event: scheduler_pb2.TokenEvent, stream: TextStream,
                  params: common_pb2.SamplingParams, adapter: str = "") -> inference_pb2.GenerateResponse:
        """One scheduler event as a client message: new text, and the finish reason when it ends (`adapter`: the
        LoRA adapter serving it, its `model`)."""
        if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
            raise ExecutionError(event.error or "generation failed")
        delta = stream.push_until_stop(list(event.token_ids))
        if delta.used_tokens is not None and delta.used_tokens < len(event.token_ids):
            event = _first_tokens(event, delta.used_tokens)  # the ones after the stop string are not the answer's
        response = inference_pb2.GenerateResponse(
            request_id=request_id, text=delta.text, token_ids=event.token_ids, model=adapter or self.model_name,
            backend=NAME, index=event.index)
        if params.track_generated_token_events:
            response.token_timestamps.extend(event.token_timestamps)
        if params.HasField("logprobs"):
            self._add_logprobs(response, event)
        if delta.stopped:
            response.finish_reason, response.stop_reason = common_pb2.FINISH_REASON_STOP, delta.stop_string or ""
        elif is_finished(event.finish_reason):
            response.text += stream.finish()
            response.finish_reason = event.finish_reason
        return response

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _add_logprobs(self, response: inference_pb2.GenerateResponse, event: scheduler_pb2.TokenEvent) -> None:
        add_token_logprobs(response.logprobs, response.top_logprobs, event.token_ids, event.logprobs,
                           event.top_logprobs, self._token_text)


def _first_tokens(event: scheduler_pb2.TokenEvent, count: int) -> scheduler_pb2.TokenEvent:
    """A copy of `event` with its first `count` tokens only (and their timestamps and logprobs)."""
    first = scheduler_pb2.TokenEvent()
    first.CopyFrom(event)
    for per_token in (first.token_ids, first.token_timestamps, first.logprobs, first.top_logprobs):
        del per_token[count:]
    return first


@dataclass
class _EventState:
    open_samples: set[int]  # samples whose last event has not come yet
    next_position: int = 0  # TokenEvent.position expected next (a replay repeats the ones before)
    started: set[int] = field(default_factory=set)  # samples whose first event has been returned
    held: object | None = None  # an item taken off the queue while coalescing, not merged: the next one
    # stream_interval > 1: per sample, its tokens not sent yet (an event, and whether it is a merge's own copy)
    pending: dict[int, tuple[scheduler_pb2.TokenEvent, bool]] = field(default_factory=dict)


def _report_end(call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue[object]) -> None:
    """Put SubmitEnded on `queue` when the Submit call ends (it carries no events itself)."""

    def ended(read: asyncio.Future[object]) -> None:
        if not read.cancelled():
            error = read.exception()
            queue.put_nowait(SubmitEnded(None if isinstance(error, asyncio.CancelledError) else error))

    asyncio.ensure_future(call.read()).add_done_callback(ended)


async def _next_event(queue: asyncio.Queue[object], state: _EventState, interval: int = 1) -> scheduler_pb2.TokenEvent:
    """The request's next event; raises the Submit call's error or the Follow stream's.

    Events of the same sample already queued behind it are merged into it (`merge_events`): when the
    client reads slower than the engine steps, one message carries several tokens instead of the queue
    growing, which costs the gateway and the client less per token (as vLLM's output collector does).
    An item that cannot be merged (another sample's event, an error) is held for the next call. The
    Submit call's end without an error carries nothing: the request's last events may come after it on
    the Follow stream, and are merged as any other. `interval` > 1 (serving.stream_interval): see
    `_next_grouped_event`."""
    if interval > 1:
        return await _next_grouped_event(queue, state, interval)
    event = await _take_event(queue, state)
    merged = False  # whether `event` is a merge's own copy, which later merges extend in place
    while not is_finished(event.finish_reason) and queue.qsize():
        item = queue.get_nowait()
        if isinstance(item, scheduler_pb2.TokenEvent):
            if item.position < state.next_position:
                continue  # replayed after a re-attach: already had it
            if can_merge(event, item):
                event, merged = merge_events(event, item, owned=merged), True
                _advance(state, item)
                continue
        elif isinstance(item, SubmitEnded) and item.error is None:
            continue  # ended OK: its last events may still be on the way on the Follow stream (_take_event)
        state.held = item
        break
    return event


async def _next_grouped_event(queue: asyncio.Queue[object], state: _EventState,
                              interval: int) -> scheduler_pb2.TokenEvent:
    """`_next_event` with serving.stream_interval N > 1. A sample's first event goes out at once (time to
    first token); its later ones are merged in a buffer of its own (`state.pending`) until it holds N
    tokens or the sample ends, and go out then. Samples are buffered apart, so the events of n > 1 samples,
    which come interleaved (one each per step), neither wait for nor cut short each other's messages. An
    error, or an event that cannot be merged into its sample's buffer, goes out after the buffered tokens."""
    while True:
        if state.pending and state.held is not None and not isinstance(state.held, scheduler_pb2.TokenEvent):
            return _flush_pending(state)  # every buffered token before the error
        item = await _next_item(queue, state)
        if isinstance(item, scheduler_pb2.TokenEvent):
            if item.position < state.next_position:
                continue  # replayed after a re-attach: already had it
            buffered = state.pending.get(item.index)
            if buffered is not None and not can_merge(buffered[0], item):
                state.held = item  # taken again next call, after its sample's buffered tokens
                return state.pending.pop(item.index)[0]
            _advance(state, item)
            if item.index not in state.started:
                state.started.add(item.index)
                return item
            if buffered is None:
                event, owned = item, False
            else:
                event, owned = merge_events(buffered[0], item, owned=buffered[1]), True
            if is_finished(event.finish_reason) or len(event.token_ids) >= interval:
                state.pending.pop(item.index, None)
                return event
            state.pending[item.index] = (event, owned)
        elif isinstance(item, SubmitEnded) and item.error is None:
            continue  # ended OK: its last events may still be on the way on the Follow stream
        elif state.pending:
            state.held = item
            return _flush_pending(state)
        else:
            _raise_item(item)


def _flush_pending(state: _EventState) -> scheduler_pb2.TokenEvent:
    """One sample's buffered tokens (the one buffered first), taken out of `state.pending`."""
    return state.pending.pop(next(iter(state.pending)))[0]


async def _take_event(queue: asyncio.Queue[object], state: _EventState) -> scheduler_pb2.TokenEvent:
    while True:
        item = await _next_item(queue, state)
        if isinstance(item, scheduler_pb2.TokenEvent):
            if item.position < state.next_position:
                continue  # replayed after a re-attach: already had it
            _advance(state, item)
            return item
        if isinstance(item, SubmitEnded) and item.error is None:
            continue  # ended OK: its last events may still be on the way on the Follow stream
        _raise_item(item)


async def _next_item(queue: asyncio.Queue[object], state: _EventState) -> object:
    """The item held back by the last call, else the queue's next."""
    if state.held is not None:
        item, state.held = state.held, None
        return item
    return queue.get_nowait() if queue.qsize() else await queue.get()


def _raise_item(item: object) -> NoReturn:
    """An item that ends the request with an error: the Submit call's (SubmitEnded) or the Follow stream's."""
    if isinstance(item, SubmitEnded):
        assert item.error is not None
        raise item.error
    assert isinstance(item, BaseException)
    raise item


def _advance(state: _EventState, event: scheduler_pb2.TokenEvent) -> None:
    state.next_position = event.position + 1
    if is_finished(event.finish_reason):
        state.open_samples.discard(event.index)
