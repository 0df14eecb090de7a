"""The OpenAI-compatible HTTP API's routes (FastAPI), in the gateway process, on its loop.

Every generation goes through `Generation.generate`, the path gRPC uses, so both
APIs validate, tokenize, stop and meter identically. Routes:
POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
`stream: true`, ending `data: [DONE]`), GET /v1/models (need an API key when keys are on);
GET /healthz, /readyz, /metrics (open, for probes and scrapers).
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import openai_schema as oa
from gateway.auth import ApiKeys
from gateway.generation import Generation
from gateway.http_streams import merged, unless_client_gone
from gateway.metrics import CONTENT_TYPE_LATEST
from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2
from hetero_common.errors import HeteroError, http_status_for

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               409: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "overloaded", 503: "not_ready"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": ERROR_CODES.get(status)}}


def error_response(exc: BaseException) -> JSONResponse:
    status = http_status_for(exc)
    message = exc.message if isinstance(exc, HeteroError) else f"internal error: {type(exc).__name__}"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class HttpApi:
    def __init__(self, generation: Generation, keys: ApiKeys,
                 scheduler_stats: Callable[[], Awaitable[scheduler_pb2.SchedulerStats]]) -> None:
        self.generation = generation
        self.keys = keys
        self.scheduler_stats = scheduler_stats  # readiness and pool metrics are the scheduler's
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="hetero-infer", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HeteroError)
        async def on_hetero(_: Request, exc: HeteroError) -> JSONResponse:
            return error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ())[1:])
            return JSONResponse(error_body(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None),
                                status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
            return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

        async def authorized(request: Request) -> None:
            self.keys.check(request.headers.get("authorization"))

        guarded = [Depends(authorized)]
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=guarded)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=guarded)
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=guarded)
        app.add_api_route("/healthz", self.healthz, methods=["GET"])
        app.add_api_route("/readyz", self.readyz, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        return app

    # ------------------------------------------------------------------ probes and metrics

    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    async def readyz(self) -> JSONResponse:
        try:
            service = (await self.scheduler_stats()).service
        except HeteroError as exc:
            return JSONResponse(error_body(503, f"not ready: {exc.message}"), status_code=503)
        if service.num_workers_up < 1:
            return JSONResponse(error_body(503, "not ready: the scheduler has no worker up"), status_code=503)
        return JSONResponse({"status": "ready", "workers_up": service.num_workers_up})

    async def metrics(self) -> Response:
        try:
            stats: scheduler_pb2.SchedulerStats | None = await self.scheduler_stats()
        except HeteroError:
            stats = None  # still serve the gateway's own metrics; hetero_scheduler_up says 0
        self.generation.metrics.update_pool(stats.pool if stats else None, stats.service if stats else None)
        return Response(self.generation.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        g = self.generation
        return {"object": "list", "data": [{"id": g.model_name, "object": "model", "created": 0, "owned_by": "hetero-infer",
                                            "max_model_len": g.max_model_len}]}

    # ------------------------------------------------------------------ generation

    async def completions(self, body: oa.CompletionBody, request: Request) -> Response:
        rid = uuid.uuid4().hex[:16]
        requests = oa.completion_requests(body, rid)
        if body.stream:
            return await self._stream(requests, body.n, rid, "text_completion", body.include_usage_in_stream)
        return await unless_client_gone(request, self._completion(requests, body.n, rid))

    async def _completion(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str) -> Response:
        parts, usages = await self._collect(requests, n, rid)
        choices = [{"index": i, "text": "".join(p.text for p in ps), "finish_reason": oa.finish_reason(ps[-1].finish_reason),
                    "stop_reason": ps[-1].stop_reason or None,
                    "logprobs": oa.completion_logprobs(self.generation.tokenizer, ps)} for i, ps in parts.items()]
        answer = oa.envelope("text_completion", rid, self.generation.model_name, choices)
        answer["usage"] = oa.usage(usages)
        return JSONResponse(answer)

    async def chat_completions(self, body: oa.ChatBody, request: Request) -> Response:
        rid = uuid.uuid4().hex[:16]
        requests = [oa.chat_request(body, rid)]
        if body.stream:
            return await self._stream(requests, body.n, rid, "chat.completion.chunk", body.include_usage_in_stream)
        return await unless_client_gone(request, self._chat_completion(requests, body.n, rid))

    async def _chat_completion(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str) -> Response:
        parts, usages = await self._collect(requests, n, rid)
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(p.text for p in ps)},
                    "finish_reason": oa.finish_reason(ps[-1].finish_reason), "stop_reason": ps[-1].stop_reason or None,
                    "logprobs": oa.chat_logprobs(ps)} for i, ps in parts.items()]
        answer = oa.envelope("chat.completion", rid, self.generation.model_name, choices)
        answer["usage"] = oa.usage(usages)
        return JSONResponse(answer)

    async def _collect(self, requests: list[inference_pb2.GenerateRequest], n: int,
                       rid: str) -> tuple[dict[int, list[inference_pb2.GenerateResponse]], list[common_pb2.Usage]]:
        """Every choice's messages (by choice index, in order) and each request's usage."""
        parts: dict[int, list[inference_pb2.GenerateResponse]] = {}
        usages: list[common_pb2.Usage] = []
        async for index, part in merged(self.generation, requests, n, rid):
            parts.setdefault(index, []).append(part)
            if part.HasField("usage"):  # a request's last message: its prompt once, all its samples
                usages.append(part.usage)
        return dict(sorted(parts.items())), usages

    async def _stream(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str, kind: str,
                      include_usage: bool) -> Response:
        """Server-sent events. The first message is awaited before answering, so a bad request still
        gets its 4xx status (not a 200 stream carrying an error)."""
        events = merged(self.generation, requests, n, rid)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except HeteroError:
            await events.aclose()
            raise
        created, model, chat = int(time.time()), self.generation.model_name, kind == "chat.completion.chunk"
        offsets: dict[int, int] = collections.defaultdict(int)

        def chunk(index: int, part: inference_pb2.GenerateResponse, first_of_choice: bool) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "finish_reason": oa.finish_reason(part.finish_reason)}
            if chat:
                delta: dict[str, Any] = {"content": part.text}
                if first_of_choice:
                    delta["role"] = "assistant"
                choice["delta"], choice["logprobs"] = delta, oa.chat_logprobs([part])
            else:
                choice["text"] = part.text
                choice["logprobs"] = oa.completion_logprobs(self.generation.tokenizer, [part], offsets[index])
                offsets[index] += len(part.text)
            if part.stop_reason:
                choice["stop_reason"] = part.stop_reason
            return oa.envelope(kind, rid, model, [choice], created)  # type: ignore[arg-type]

        async def body() -> AsyncIterator[bytes]:
            started: set[int] = set()
            usages: list[common_pb2.Usage] = []
            try:
                pending = [first] if first is not None else []
                while True:
                    for index, part in pending:
                        yield _sse(chunk(index, part, index not in started))
                        started.add(index)
                        if part.HasField("usage"):
                            usages.append(part.usage)
                    try:
                        pending = [await anext(events)]
                    except StopAsyncIteration:
                        break
                if include_usage:
                    yield _sse({**oa.envelope(kind, rid, model, [], created), "usage": oa.usage(usages)})  # type: ignore[arg-type]
            except HeteroError as exc:  # after the 200 went out: report in-band, as OpenAI does
                yield _sse(error_body(http_status_for(exc), exc.message))
            finally:
                await events.aclose()
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
