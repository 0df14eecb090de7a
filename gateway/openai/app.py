"""The OpenAI-compatible HTTP API's routes (FastAPI), in the gateway process, on its loop.

Every generation goes through `Generation.generate`, the path gRPC uses, so both
APIs validate, tokenize, stop and meter identically. Routes:
POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
`stream: true`, ending `data: [DONE]`), GET /v1/models, POST /tokenize, POST /detokenize,
GET /tokenizer_info (need an API key when keys are on); GET /healthz, /readyz, /metrics,
/openapi.json (open, for probes, scrapers and API tools; /metrics needs a key with
serving.metrics_require_key). Bodies over serving.max_request_bytes get 413 before they are
read (`body_limit.py`).

Every request field is honoured or refused with a 400 naming it (`error.param`): the bodies
are `bodies`, and pydantic's errors are reported here in OpenAI's error shape.
"""

from __future__ import annotations

import collections
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import ApiKeys
from gateway.embedding import Embeddings
from gateway.generation import Generation
from gateway.metrics import CONTENT_TYPE_LATEST
from gateway.openai import schema as oa
from gateway.openai.body_limit import BodyLimitMiddleware
from gateway.openai.embedding_routes import EmbeddingRoutes
from gateway.openai.http_auth import ApiKeyMiddleware
from gateway.openai.json_body import OTHER_VALUES, CountedJsonRoute
from gateway.openai.lora_routes import LoraRoutes
from gateway.openai.prompt_echo import PromptShaping
from gateway.openai.request_id import OPENAPI_PARAMETER, RequestIdMiddleware, request_id
from gateway.openai.streams import merged, unless_client_gone
from gateway.openai.structured import renamed_errors
from gateway.openai.tokenizer_routes import TokenizerRoutes
from gateway.openai.tools import call_deltas, chat_message
from gateway.text.chat import chat_chars
from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2
from hetero_common.config import ServingConfig
from hetero_common.errors import HeteroError, ValidationError, http_status_for
from hetero_common.grpc_server import internal_error_message
from hetero_common.tokenizer import TextTokenizer

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error",
               408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}
ERROR_CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "model_not_found", 429: "overloaded", 503: "not_ready"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": ERROR_CODES.get(status)}}


# A message from the shared validation path starts with the field it names ("prompt is 300
# tokens; ...", "params.top_k must be ..."): that field is the OpenAI `param`.
_LEADING_FIELD = re.compile(r"^(?:params\.)?([a-z_]+)(?=[ :])")
_BODY_FIELDS = set(oa.CompletionBody.model_fields) | set(oa.ChatBody.model_fields)


def error_param(exc: BaseException) -> str | None:
    if not isinstance(exc, ValidationError):
        return None
    if exc.param is not None:
        return exc.param
    match = _LEADING_FIELD.match(exc.message)
    return match.group(1) if match and match.group(1) in _BODY_FIELDS else None


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """Our errors in OpenAI's shape; any other is a bug: a 500 saying only that, with the request id
    (`request_id`, the X-Request-Id echoed), and logged in full (`internal_error_message`)."""
    status = http_status_for(exc)
    message = exc.message if isinstance(exc, HeteroError) else internal_error_message(exc, request_id)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, error_param(exc)), status_code=status, headers=headers)


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}  # pydantic's union-member names


def _param(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as a field path, e.g. ('body', 'messages', 0, 'content') ->
    'messages[0].content'; union-member tags ('list[int]', 'str') and '[key]' are left out."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "header", "query") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _IDENTIFIER.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        elif isinstance(part, str) and part.isdecimal() and out:  # a dict key (logit_bias's token ids)
            out += f"[{part}]"
    return out or None


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The most specific of pydantic's errors (a union reports one per member; the deepest is the
    member the client meant), as an OpenAI 400."""
    if not errors:
        return error_body(400, "invalid request body")
    first = max(errors, key=lambda e: len(_param(tuple(e.get("loc", ()))) or ""))
    param = _param(tuple(first.get("loc", ())))
    kind, msg = first.get("type"), first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return error_body(400, f"unknown field '{param}': this server does not serve it", param)
    if kind == "json_invalid":
        return error_body(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}")
    if kind == "missing":
        msg = "field required"
    return error_body(400, f"{param or 'body'}: {msg}", param)


Event = tuple[int, inference_pb2.GenerateResponse]  # a streamed message: (choice index, message)
StreamKind = Literal["text_completion", "chat.completion.chunk"]


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


class HttpApi:
    def __init__(self, generation: Generation, keys: ApiKeys,
                 scheduler_stats: Callable[[], Awaitable[scheduler_pb2.SchedulerStats]],
                 serving: ServingConfig | None = None, embeddings: Embeddings | None = None) -> None:
        self.generation = generation
        self.keys = keys
        self.scheduler_stats = scheduler_stats  # readiness and pool metrics are the scheduler's
        self.serving = serving or ServingConfig()  # the limits (max_request_bytes, ...) and metrics_require_key
        self.tokenizer_routes = TokenizerRoutes(generation)
        self.lora_routes = LoraRoutes(generation)
        self.embedding_routes = EmbeddingRoutes(embeddings or Embeddings(self.serving.embedding, generation, None))
        self.fastapi = self._build()
        limited = BodyLimitMiddleware(self.fastapi, self.serving.max_request_bytes, self.serving.http_body_timeout_s,
                                      error_body, generation.heap_trimmer.release_later)  # a large body: trim after
        # The key checked before the body is read (http_auth.py), then the request id on every answer.
        guarded = ApiKeyMiddleware(limited, keys, self.serving.metrics_require_key, error_body)
        self.app = RequestIdMiddleware(guarded, error_body)  # what uvicorn serves

    def _build(self) -> FastAPI:
        # /openapi.json is open (API tools and fuzzers read it); /docs and /redoc stay off.
        app = FastAPI(title="hetero-infer", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
        app.router.route_class = CountedJsonRoute  # bodies of too many small values refused unparsed (json_body.py)
        app.state.json_value_cap = lambda: self.generation.max_model_len + OTHER_VALUES

        @app.exception_handler(HeteroError)
        async def on_hetero(_: Request, exc: HeteroError) -> JSONResponse:
            return error_response(exc)

        @app.exception_handler(Exception)  # else Starlette answers a bare text/plain 500
        async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
            return error_response(exc, request.scope.get("state", {}).get("request_id"))

        @app.exception_handler(RequestValidationError)
        async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
            return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

        documented = {"parameters": [OPENAPI_PARAMETER]}  # the header the middleware reads
        tok, lora = self.tokenizer_routes, self.lora_routes
        for path, handler, method in (("/v1/load_lora_adapter", lora.load, "POST"),
                                      ("/v1/unload_lora_adapter", lora.unload, "POST"),
                                      ("/v1/lora_adapters", lora.adapters, "GET"),
                                      ("/v1/completions", self.completions, "POST"),
                                      ("/v1/chat/completions", self.chat_completions, "POST"),
                                      ("/v1/embeddings", self.embedding_routes.create, "POST"),
                                      ("/v1/models", self.models, "GET"), ("/tokenize", tok.tokenize, "POST"),
                                      ("/detokenize", tok.detokenize, "POST"), ("/tokenizer_info", tok.tokenizer_info, "GET")):
            app.add_api_route(path, handler, methods=[method], openapi_extra=documented)  # keys: http_auth.py
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
        t = g.tokenizer
        facts = await g.model_facts()
        card = {"object": "model", "created": 0, "owned_by": "hetero-infer", "max_model_len": g.max_model_len,
                "vocab_size": t.vocab_size, "eos_token_ids": list(t.eos_token_ids), "bos_token_id": t.bos_token_id,
                "architecture": facts.architecture or None, "num_experts": facts.num_experts,
                "num_experts_per_tok": facts.num_experts_per_tok}
        # The base model, then each LoRA adapter a request's `model` may name (`parent`: vLLM's field).
        return {"object": "list", "data": [{"id": g.model_name, **card, "root": g.model_name, "parent": None}]
                + [{"id": a.name, **card, "root": a.path or a.name, "parent": g.model_name}
                   for a in await g.lora_adapters()]}

    # ------------------------------------------------------------------ generation

    async def completions(self, body: oa.CompletionBody, request: Request) -> Response:
        oa.check_prompt_count(body, self.serving.max_prompts_per_request)  # before any prompt is tokenized
        rid = request_id(request.scope)
        g = self.generation  # tokenizing a large prompt: off the loop (gateway/text/tokenizer_pool.py)
        chars = oa.prompt_chars(body)
        requests = await g.tokenizer_pool.run(oa.completion_requests, body, rid, g.tokenizer, g.max_model_len,
                                              chars=chars if body.add_special_tokens is False else 0)
        shaping = await g.tokenizer_pool.run(PromptShaping.build, g.tokenizer, requests, body.n, body.echo, body.logprobs,
                                             body.prompt_logprobs, g.max_model_len,
                                             chars=chars if body.echo or body.prompt_logprobs is not None else 0)
        renames = oa.error_renames(body)
        if body.stream:
            return await self._stream(requests, body.n, rid, "text_completion", body.include_usage_in_stream, shaping,
                                      renames)
        return await unless_client_gone(request, self._completion(requests, body.n, rid, shaping, renames))

    async def _completion(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str,
                          shaping: PromptShaping | None, renames: dict[str, str]) -> Response:
        parts, usages = await self._collect(requests, n, rid, shaping, renames)
        choices = [{"index": i, "text": "".join(p.text for p in ps), "finish_reason": oa.finish_reason(ps[-1].finish_reason),
                    "stop_reason": ps[-1].stop_reason or None,
                    "logprobs": oa.completion_logprobs(self.generation.tokenizer, ps, shaping.text_offset(i) if shaping else 0)}
                   for i, ps in parts.items()]
        for choice in choices if shaping else []:
            shaping.completion_choice(choice, choice["index"])  # type: ignore[union-attr]
        answer = oa.envelope("text_completion", rid, requests[0].model or self.generation.model_name, choices)
        answer["usage"] = oa.usage(usages)
        return JSONResponse(answer)

    async def chat_completions(self, body: oa.ChatBody, request: Request) -> Response:
        rid = request_id(request.scope)
        g = self.generation
        requests = [oa.chat_request(body, rid, g.tokenizer)]
        shaping = await g.tokenizer_pool.run(PromptShaping.build, g.tokenizer, requests, body.n, False, None,
                                             body.prompt_logprobs, g.max_model_len,
                                             chars=chat_chars(requests[0].chat) if body.prompt_logprobs is not None else 0)
        renames = oa.error_renames(body)
        if body.stream:
            return await self._stream(requests, body.n, rid, "chat.completion.chunk", body.include_usage_in_stream,
                                      shaping, renames)
        return await unless_client_gone(request, self._chat_completion(requests, body.n, rid, shaping, renames))

    async def _chat_completion(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str,
                               shaping: PromptShaping | None, renames: dict[str, str]) -> Response:
        parts, usages = await self._collect(requests, n, rid, shaping, renames)
        choices = [{"index": i, "message": chat_message(ps),
                    "finish_reason": oa.finish_reason(ps[-1].finish_reason), "stop_reason": ps[-1].stop_reason or None,
                    "logprobs": oa.chat_logprobs(ps)} for i, ps in parts.items()]
        for choice in choices if shaping else []:
            shaping.chat_choice(choice, choice["index"])  # type: ignore[union-attr]
        answer = oa.envelope("chat.completion", rid, requests[0].model or self.generation.model_name, choices)
        answer["usage"] = oa.usage(usages)
        return JSONResponse(answer)

    async def _collect(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str,
                       shaping: PromptShaping | None = None, renames: dict[str, str] | None = None,
                       ) -> tuple[dict[int, list[inference_pb2.GenerateResponse]], list[common_pb2.Usage]]:
        """Every choice's messages (by choice index, in order) and each request's usage."""
        parts: dict[int, list[inference_pb2.GenerateResponse]] = {}
        usages: list[common_pb2.Usage] = []
        async for index, part in renamed_errors(merged(self.generation, requests, n, rid), renames or {}):
            parts.setdefault(index, []).append(part)
            if shaping:
                shaping.observe(index, part)
            if part.HasField("usage"):  # a request's last message: its prompt once, all its samples
                usages.append(part.usage)
        return dict(sorted(parts.items())), usages

    async def _stream(self, requests: list[inference_pb2.GenerateRequest], n: int, rid: str, kind: StreamKind,
                      include_usage: bool, shaping: PromptShaping | None = None,
                      renames: dict[str, str] | None = None) -> Response:
        """Server-sent events. The first message is awaited before answering, so a bad request still
        gets its 4xx status (not a 200 stream carrying an error)."""
        events = renamed_errors(merged(self.generation, requests, n, rid), renames or {})
        first = await _first_event(events)
        model = requests[0].model or self.generation.model_name  # the base model or the adapter it names
        chunks = StreamChunks(kind, rid, model, self.generation.tokenizer, shaping)
        return StreamingResponse(_sse_frames(events, first, chunks, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


async def _first_event(events: AsyncGenerator[Event, None]) -> Event | None:
    """The stream's first message (None: there is none); an error before it is raised, for its status."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except HeteroError:
        await events.aclose()
        raise


async def _sse_frames(events: AsyncGenerator[Event, None], first: Event | None, chunks: StreamChunks,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """Each message's chunks as `data:` frames, the usage chunk when asked for, then `[DONE]`. An
    error after the 200 went out is reported in-band, as OpenAI does."""
    try:
        if first is not None:
            for chunk in chunks.of_message(*first):
                yield _sse(chunk)
        async for index, part in events:
            for chunk in chunks.of_message(index, part):
                yield _sse(chunk)
        if include_usage:
            yield _sse(chunks.usage_chunk())
    except HeteroError as exc:
        yield _sse(error_body(http_status_for(exc), exc.message, error_param(exc)))
    except Exception as exc:  # a bug after the 200: reported in-band, generically (the detail is logged)
        yield _sse(error_body(500, internal_error_message(exc, chunks.rid), None))
    finally:
        await events.aclose()
    yield _sse("[DONE]")


@dataclass
class StreamChunks:
    """The chunks of one streamed answer, message by message, and what they carry over: which
    choices have started (the first chunk of each has the role and the prompt), each choice's
    text offset (completion logprobs), and the requests' usages (the last chunk's sum)."""

    kind: StreamKind
    rid: str
    model: str
    tokenizer: TextTokenizer
    shaping: PromptShaping | None
    created: int = field(default_factory=lambda: int(time.time()))
    started: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    usages: list[common_pb2.Usage] = field(default_factory=list)

    def of_message(self, index: int, part: inference_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """One chunk, or with tool calls (chat) one per piece of them (the finish reason on the last)."""
        first = self._chunk(index, part, index not in self.started)
        self.started.add(index)
        if part.HasField("usage"):  # a request's last message
            self.usages.append(part.usage)
        if not part.tool_calls:
            return [first]
        pieces = call_deltas(list(part.tool_calls))
        out = [first] + [oa.envelope(self.kind, self.rid, self.model, [{"index": index, "delta": {"tool_calls": d},
                                                                        "logprobs": None, "finish_reason": None}],
                                     self.created) for d in pieces]
        out[-1]["choices"][0]["finish_reason"], first["choices"][0]["finish_reason"] = "tool_calls", None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return {**oa.envelope(self.kind, self.rid, self.model, [], self.created), "usage": oa.usage(self.usages)}

    def _chunk(self, index: int, part: inference_pb2.GenerateResponse, first_of_choice: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": oa.finish_reason(part.finish_reason)}
        shape = self.shaping if first_of_choice else None  # the prompt goes in each choice's first chunk
        if self.shaping:
            self.shaping.observe(index, part)
        if self.kind == "chat.completion.chunk":
            self._chat_choice(choice, index, part, first_of_choice, shape)
        else:
            self._text_choice(choice, index, part, shape)
        if part.stop_reason:
            choice["stop_reason"] = part.stop_reason
        return oa.envelope(self.kind, self.rid, self.model, [choice], self.created)

    @staticmethod
    def _chat_choice(choice: dict[str, Any], index: int, part: inference_pb2.GenerateResponse, first_of_choice: bool,
                     shape: PromptShaping | None) -> None:
        delta: dict[str, Any] = {"content": part.text}
        if first_of_choice:
            delta["role"] = "assistant"
        choice["delta"], choice["logprobs"] = delta, oa.chat_logprobs([part])
        if shape:
            shape.chat_choice(choice, index)

    def _text_choice(self, choice: dict[str, Any], index: int, part: inference_pb2.GenerateResponse,
                     shape: PromptShaping | None) -> None:
        if shape:
            self.offsets[index] = shape.text_offset(index)
        choice["text"] = part.text
        choice["logprobs"] = oa.completion_logprobs(self.tokenizer, [part], self.offsets[index])
        self.offsets[index] += len(part.text)
        if shape:
            shape.completion_choice(choice, index)
