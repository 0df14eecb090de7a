"""The gateway process: the public `hetero.v1.Inference` API over grpc.aio.

The gateway knows text. It validates and tokenizes a request, submits token ids to the
scheduler, and turns the scheduler's token events back into text (incrementally, never a
broken UTF-8 character), ending the request itself when a stop string appears. When the
client cancels or disconnects, the downstream Submit call is cancelled, which aborts the
request in the scheduler and frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from gateway.auth import ApiKeyInterceptor, ApiKeys
from gateway.command_bridge import CommandBridge, TextBackend, bridge_prompt
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.requests import PreparedRequest, check_model, prepare, render_chat
from gateway.text_stream import TextStream
from gateway.tokenizer import TextTokenizer, load_tokenizer
from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from hetero_common import __version__
from hetero_common.config import Config
from hetero_common.errors import (ExecutionError, HeteroError, OverloadedError, UnavailableError, ValidationError,
                                 from_grpc_error)
from hetero_common.grpc_server import (CHANNEL_OPTIONS, add_health_and_reflection, bind, error_status,
                                      internal_channel, server_credentials, set_serving_aio)
from hetero_common.model_files import resolve_model_path
from hetero_common.sampling import sample_seed

log = structlog.get_logger("gateway.service")
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


def load_gateway_tokenizer(config: Config) -> TextTokenizer:
    return load_tokenizer(resolve_model_path(config.model), config.tokenizer.path)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, config: Config, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.serving.model_name
        self.max_model_len = config.max_model_len  # refined from the scheduler at start
        self.channel = internal_channel(config, config.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.metrics = GatewayMetrics()
        self.in_flight = 0  # generations streaming now (gRPC and HTTP), for serving.max_concurrent_requests
        # The command bridge answers every request (primary) or those the scheduler cannot (fallback).
        backend = config.serving.backend
        self.bridge: TextBackend | None = CommandBridge(backend) if backend.command and backend.command.program else None
        self.bridge_is_primary = backend.kind == "command_bridge"
        self.bridge_is_fallback = backend.fallback == "command_bridge"

    def _retrying(self) -> AsyncRetrying:
        """Transient (UNAVAILABLE) failures: at most max_retry_attempts retries, exponential backoff with jitter."""
        return AsyncRetrying(stop=stop_after_attempt(self.config.max_retry_attempts + 1), reraise=True,
                             wait=wait_exponential_jitter(initial=self.config.retry_backoff_s, max=1.0),
                             retry=retry_if_exception(_transient))

    async def start(self) -> None:
        if self.bridge_is_primary:
            return
        try:
            stats = await self._scheduler_stats()
            self.max_model_len = stats.max_model_len
        except HeteroError as exc:
            log.warning("scheduler not reachable at start; using config max_model_len", error=exc.message)

    async def scheduler_stats(self) -> scheduler_pb2.SchedulerStats:
        """The scheduler's pool and model figures (retried on UNAVAILABLE); for /readyz and /metrics."""
        return await self._scheduler_stats()

    async def _scheduler_stats(self) -> scheduler_pb2.SchedulerStats:
        try:
            async for attempt in self._retrying():
                with attempt:
                    return await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_error(exc, "scheduler") from exc
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ generation

    async def _events(self, prepared: PreparedRequest, params: common_pb2.SamplingParams,
                      timeout: float | None = None, cache_salt: str = "") -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """The scheduler's token events. Failing to reach it (before the first event) is retried;
        the scheduler treats a repeated request id as the same request, so a retry never starts
        a second generation. `timeout` (the client's remaining time) becomes the Submit deadline."""
        submit = scheduler_pb2.SubmitRequest(request_id=prepared.request_id, prompt_token_ids=prepared.prompt_token_ids,
                                             params=params, cache_salt=cache_salt)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        call: grpc.aio.UnaryStreamCall | None = None
        attempts = 0
        try:
            try:
                async for attempt in self._retrying():
                    with attempt:
                        if call is not None:
                            call.cancel()
                        attempts += 1
                        call = self.scheduler.Submit(
                            submit, timeout=None if deadline is None else max(0.001, deadline - loop.time()))
                        event = await call.read()
                while event is not grpc.aio.EOF:
                    yield event
                    event = await call.read()
            except grpc.aio.AioRpcError as exc:
                error = from_grpc_error(exc, "scheduler")
                if isinstance(error, UnavailableError):
                    error = UnavailableError(f"{error.message} (after {attempts} attempt(s); max_retry_attempts is "
                                             f"{self.config.max_retry_attempts})")
                raise error from exc
        finally:
            if call is not None:
                call.cancel()  # no-op when finished; aborts the request downstream otherwise

    async def generate(self, request: inference_pb2.GenerateRequest,
                       timeout: float | None = None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The one generation path, shared by gRPC (Generate, Complete) and the HTTP API; metered.

        `timeout` is the client's remaining time (gRPC deadline); it becomes the Submit deadline."""
        limit = self.config.serving.max_concurrent_requests
        if limit and self.in_flight >= limit:
            self.metrics.request_errors.labels(OverloadedError.__name__).inc()
            raise OverloadedError(f"the gateway is serving its limit of {limit} concurrent requests "
                                  "(serving.max_concurrent_requests); retry later")
        self.in_flight += 1
        timer = self.metrics.start_request()
        try:
            async with aclosing(self._generate(request, timer, timeout)) as responses:
                async for response in responses:
                    yield response
        except BaseException as exc:  # errors, and a client going away (GeneratorExit, CancelledError)
            timer.fail(exc)
            raise
        finally:
            self.in_flight -= 1

    async def _generate(self, request: inference_pb2.GenerateRequest, timer: RequestTimer,
                        timeout: float | None = None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The request's messages; with n > 1 the samples' messages interleave, each with its `index`.

        Each sample has its own detokenizer and stop-string state. A sample that matches a
        stop string is aborted downstream alone; the stream ends when every sample has finished,
        and the last message carries `usage` for all samples.
        """
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        structlog.contextvars.bind_contextvars(request_id=request_id)
        started = time.perf_counter()
        prepared = prepare(request, self.tokenizer, self.model_name, self.max_model_len, request_id)
        usage = common_pb2.Usage(prompt_tokens=len(prepared.prompt_token_ids))
        if self.bridge_is_primary:
            async for response in self._bridge_responses(request, prepared, usage, timer):
                yield response
            return
        n = prepared.sampling.n
        streams = {i: TextStream(self.tokenizer, prepared.prompt_token_ids, prepared.sampling) for i in range(n)}
        finish = FINISHED
        received = False
        try:
            # aclosing: leaving the loop early (stop string) closes the generator at once, which
            # cancels the Submit call and so ends the request downstream.
            async with aclosing(self._events(prepared, request.params, timeout, request.cache_salt)) as events:
                async for event in events:
                    received = True
                    stream = streams.get(event.index)
                    if stream is None:
                        continue  # this sample already ended (stop string) before its abort landed
                    usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, event.cached_prompt_tokens)
                    usage.completion_tokens += len(event.token_ids)
                    timer.on_tokens(len(event.token_ids), event.queue_seconds)
                    response = self._response(request_id, event, stream, request.params)
                    finish = response.finish_reason
                    if finish != FINISHED:
                        del streams[event.index]
                        if n > 1 and response.stop_reason and streams:  # only this sample ends
                            await self._abort_sample(request_id, event.index)
                        if not streams:
                            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                            response.usage.CopyFrom(usage)
                            timer.finish(finish, usage)
                    yield response
                    if not streams:
                        break
        except UnavailableError as exc:
            if received or not self.bridge_is_fallback:
                raise
            log.warning("scheduler unavailable after retries; answering with the command bridge", error=exc.message)
            async for response in self._bridge_responses(request, prepared, usage, timer):
                yield response
            return
        log.info("finished", finish_reason=common_pb2.FinishReason.Name(finish), prompt_tokens=usage.prompt_tokens,
                 completion_tokens=usage.completion_tokens, n=n, seconds=round(time.perf_counter() - started, 3))

    async def _abort_sample(self, request_id: str, index: int) -> None:
        try:
            await self.scheduler.Abort(scheduler_pb2.AbortRequest(
                request_id=request_id, reason=common_pb2.FINISH_REASON_STOP, index=index), timeout=10)
        except grpc.aio.AioRpcError as exc:  # the sample runs on to its max_tokens; its tokens are dropped here
            log.warning("could not abort a stopped sample", index=index, error=exc.details())

    async def _bridge_responses(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                                usage: common_pb2.Usage, timer: RequestTimer) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The command bridge's text as responses marked backend="command_bridge". With n > 1 the
        program runs once per sample, one after another, each with the sample's seed (as the
        engine derives it) and HETERO_SAMPLE_INDEX; `usage` comes with the last sample's end."""
        assert self.bridge is not None
        prompt, sampling, n = bridge_prompt(request, self.tokenizer), prepared.sampling, prepared.sampling.n
        for index in range(n):
            if index and sampling.seed is not None:
                sampling = dataclasses.replace(prepared.sampling, seed=sample_seed(prepared.sampling.seed, index))
            text: list[str] = []
            async for chunk in self.bridge.stream(prepared.request_id, prompt, sampling, self.model_name, index):
                text.append(chunk.text)
                response = inference_pb2.GenerateResponse(request_id=prepared.request_id, text=chunk.text, index=index,
                                                          model=self.model_name, backend=self.bridge.name)
                if chunk.finished:
                    response.finish_reason = (common_pb2.FINISH_REASON_LENGTH if chunk.truncated
                                              else common_pb2.FINISH_REASON_STOP)
                    tokens = len(self.tokenizer.encode("".join(text), add_special_tokens=False))
                    usage.completion_tokens += tokens
                    timer.on_tokens(tokens)
                    if index == n - 1:
                        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                        response.usage.CopyFrom(usage)
                        timer.finish(response.finish_reason, usage)
                yield response
        log.info("finished", backend=self.bridge.name, completion_tokens=usage.completion_tokens)

    def _response(self, request_id: str, event: scheduler_pb2.TokenEvent, stream: TextStream,
                  params: common_pb2.SamplingParams) -> inference_pb2.GenerateResponse:
        """One scheduler event as a client message: new text, and the finish reason when it ends."""
        if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
            raise ExecutionError(event.error or "generation failed")
        delta = stream.push(list(event.token_ids))
        response = inference_pb2.GenerateResponse(
            request_id=request_id, text=delta.text, token_ids=event.token_ids, model=self.model_name,
            backend="scheduler", index=event.index)
        if params.track_generated_token_events:
            response.token_timestamps.extend(event.token_timestamps)
        if params.HasField("logprobs"):
            self._add_logprobs(response, event)
        if delta.stopped:
            response.finish_reason, response.stop_reason = common_pb2.FINISH_REASON_STOP, delta.stop_string or ""
        elif event.finish_reason != FINISHED:
            response.text += stream.finish()
            response.finish_reason = event.finish_reason
        return response

    def _add_logprobs(self, response: inference_pb2.GenerateResponse, event: scheduler_pb2.TokenEvent) -> None:
        token = lambda i: self.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs)):
            response.logprobs.add(token_id=token_id, logprob=logprob, token=token(token_id))
            alternatives = response.top_logprobs.add()
            if i < len(event.top_logprobs):
                top = event.top_logprobs[i]
                for alt_id, alt_logprob in zip(top.token_ids, top.logprobs):
                    alternatives.candidates.add(token_id=alt_id, logprob=alt_logprob, token=token(alt_id))

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self.generate(request, context.time_remaining()):
                yield response
        except HeteroError as exc:
            log.info("request failed", error=exc.message, code=error_status(exc)[0].name)
            await context.abort(*error_status(exc))
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def Complete(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> inference_pb2.GenerateResponse:
        """The whole answer at once. With n > 1 the top-level fields are sample 0 and `choices`
        holds every sample (index 0..n-1); `usage` counts all samples."""
        answers: dict[int, inference_pb2.GenerateResponse] = {}
        usage = common_pb2.Usage()
        try:
            async for part in self.generate(request, context.time_remaining()):
                answer = answers.setdefault(part.index, inference_pb2.GenerateResponse(index=part.index))
                answer.request_id, answer.model, answer.backend = part.request_id, part.model, part.backend
                answer.text += part.text
                answer.token_ids.extend(part.token_ids)
                answer.token_timestamps.extend(part.token_timestamps)
                answer.logprobs.extend(part.logprobs)
                answer.top_logprobs.extend(part.top_logprobs)
                if part.finish_reason != FINISHED:
                    answer.finish_reason, answer.stop_reason = part.finish_reason, part.stop_reason
                if part.HasField("usage"):
                    usage.CopyFrom(part.usage)
        except HeteroError as exc:
            log.info("request failed", error=exc.message)
            await context.abort(*error_status(exc))
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        result = inference_pb2.GenerateResponse()
        if answers:
            result.CopyFrom(answers[min(answers)])
        result.usage.CopyFrom(usage)
        if len(answers) > 1:
            for index in sorted(answers):
                result.choices.append(answers[index])
        return result

    # ------------------------------------------------------------------ the rest of the API

    async def Tokenize(self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> inference_pb2.TokenizeResponse:
        try:
            check_model(request.model, self.model_name)
            kind = request.WhichOneof("input")
            if kind == "chat":
                ids = self.tokenizer.encode(render_chat(self.tokenizer, request.chat), add_special_tokens=False)
            elif kind == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.tokenizer.encode(request.text, add_special_tokens=add)
            else:
                raise ValidationError("one of text or chat is required")
        except HeteroError as exc:
            await context.abort(*error_status(exc))
        tokens = [self.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return inference_pb2.TokenizeResponse(token_ids=ids, tokens=tokens, count=len(ids), max_model_len=self.max_model_len)

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        card = inference_pb2.ModelCard(id=self.model_name, max_model_len=self.max_model_len,
                                       vocab_size=self.tokenizer.vocab_size,
                                       has_chat_template=bool(self.tokenizer.chat_template))
        return inference_pb2.ListModelsResponse(models=[card])

    async def GetServerInfo(self, request: inference_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> inference_pb2.ServerInfo:
        if self.bridge_is_primary:
            return inference_pb2.ServerInfo(version=__version__, model=self.model_name, backend="command_bridge")
        try:
            stats = await self._scheduler_stats()
        except HeteroError as exc:
            await context.abort(*error_status(exc))
        return inference_pb2.ServerInfo(version=__version__, model=self.model_name, pool=stats.pool, backend="scheduler",
                                        attention_backend=stats.attention_backend, device=stats.device, service=stats.service)


async def serve_gateway(config: Config) -> None:
    """gRPC and (unless serving.http_port is 0) the OpenAI-style HTTP API, on one asyncio loop, one backend."""
    servicer = InferenceServicer(config, load_gateway_tokenizer(config))
    keys = ApiKeys.from_config(config)
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [])
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], aio=True)
    address = f"{config.serving.host}:{config.serving.port}"
    if bind(server, address, server_credentials(config.serving.tls, mutual=False)) == 0:
        raise SystemExit(f"gateway: cannot bind {address}; is another process using it?")
    await server.start()
    await servicer.start()
    http = None
    if config.serving.http_port:
        from gateway.http_api import start_http_server

        http = await start_http_server(config, servicer, keys)
    await set_serving_aio(health, [SERVICE_NAME])
    log.info("gateway serving", address=address, http_port=config.serving.http_port or None, model=config.serving.model_name,
             tls=config.serving.tls.enabled, api_keys=keys.enabled)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: report NOT_SERVING, refuse new calls, give in-flight ones drain_grace_s to finish.
    await set_serving_aio(health, [SERVICE_NAME], serving=False)
    log.info("draining", grace_s=config.drain_grace_s)
    if http is not None:
        await http.stop()
    await server.stop(grace=config.drain_grace_s)
    log.info("gateway stopped")
