"""The one generation path, shared by gRPC (Generate, Complete) and the HTTP API.

It refuses what is over the concurrency limit, validates and tokenizes the request, and
streams the backend's messages through, metered, with `usage` on the request's last message
(after every sample has finished). Whichever backend answers, both APIs validate, stop and
meter identically. It also keeps the registry of requests in flight (`active_requests.py`)
that the public `Abort` looks up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing, contextmanager
from typing import AsyncIterator, Iterator

import structlog

from gateway.auth import current_principal, require_admin
from gateway.backends.backend import Backend
from gateway.limits.active_requests import ActiveRequests
from gateway.limits.heap_trim import HeapTrimmer
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.text.tokenizer_pool import INLINE_CHARS, TokenizerPool
from gateway.text.tool_stream import ToolCallStream, tool_request
from gateway.validation import PreparedRequest, check_model, input_chars, prepare, refuse_unfitting
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import Config
from hetero_common.errors import OverloadedError
from hetero_common.finish_reasons import NOT_FINISHED, finish_reason_name, is_finished
from hetero_common.tenancy import client_id, scoped_id
from hetero_common.tokenizer import TextTokenizer

log = structlog.get_logger("gateway.generation")


class Generation:
    def __init__(self, config: Config, tokenizer: TextTokenizer, backend: Backend) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.model_name = config.serving.model_name
        self.max_model_len = config.max_model_len  # refined from the backend at start
        self.max_concurrent_requests = config.serving.max_concurrent_requests
        self.metrics = GatewayMetrics()
        self.in_flight = 0  # requests in flight now (generations and embeddings, gRPC and HTTP): request_slot
        self.active = ActiveRequests()
        self.heap_trimmer = HeapTrimmer()  # gives back what large inputs leave in malloc's arenas (heap_trim.py)
        self.tokenizer_pool = TokenizerPool(config.serving.tokenizer_workers, config.serving.tokenizer_queue,
                                            self.heap_trimmer)
        self._watches: list[asyncio.Task[None]] = []
        self._model_facts: inference_pb2.ModelCard | None = None

    async def start(self) -> None:
        self._watches = [asyncio.create_task(self.metrics.watch_loop()),  # hetero_gateway_event_loop_lag_seconds
                         asyncio.create_task(self.heap_trimmer.watch())]
        max_model_len = await self.backend.max_model_len()
        if max_model_len is not None:
            self.max_model_len = max_model_len

    async def model_facts(self) -> inference_pb2.ModelCard:
        """The served model's architecture and experts (ListModels, /v1/models): asked of the backend until it
        knows them (a worker has joined), then kept."""
        if self._model_facts is None or not self._model_facts.architecture:
            self._model_facts = await self.backend.model_facts()
        return self._model_facts

    async def generate(self, request: inference_pb2.GenerateRequest, timeout: float | None = None,
                       client_request_id: str | None = None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The request's messages; with n > 1 the samples' messages interleave, each with its `index`.

        `timeout` is the client's remaining time (gRPC deadline); it becomes the Submit deadline.
        `client_request_id`: the id the client knows this generation by when it differs from
        `request.request_id` (HTTP's X-Request-Id, from which `{id}-{prompt index}` derive);
        logged with the request, and the key a public abort by id finds it under."""
        if client_request_id is not None and client_request_id != request.request_id:
            structlog.contextvars.bind_contextvars(client_request_id=client_request_id)
        with self.request_slot():
            timer = self.metrics.start_request()
            try:
                async with aclosing(self._generate(request, timer, timeout)) as responses:
                    async for response in responses:
                        yield response
            except BaseException as exc:  # errors, and a client going away (GeneratorExit, CancelledError)
                timer.fail(exc)
                raise

    @contextmanager
    def request_slot(self) -> Iterator[None]:
        """One of serving.max_concurrent_requests for a request's life (a generation or an embedding request,
        gRPC or HTTP); over the limit, refused as overloaded (and counted)."""
        limit = self.max_concurrent_requests
        if limit and self.in_flight >= limit:
            self.metrics.request_errors.labels(OverloadedError.__name__).inc()
            raise OverloadedError(f"the gateway is serving its limit of {limit} concurrent requests "
                                  "(serving.max_concurrent_requests); retry later")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def _generate(self, request: inference_pb2.GenerateRequest, timer: RequestTimer,
                        timeout: float | None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        tenant = current_principal().tenant
        structlog.contextvars.bind_contextvars(request_id=request_id, **({"tenant": tenant} if tenant else {}))
        started = time.perf_counter()
        request, tools = tool_request(request)  # tool_choice required / named: the call's schema as the constraint
        # Tokenizing a large input, and compiling a constraint (and, once, llguidance's tokenizer: milliseconds to a
        # second for a large grammar), run off the event loop (tokenizer_pool.py); a prompt that cannot fit is
        # refused before either.
        constrained = request.params.WhichOneof("constraint") is not None
        chars = input_chars(request)
        # Refused or not, a long input leaves memory to give back (the trimmer's watch finds the rest, such
        # as a large logit_bias map, without a ByteSize walk of every request on the loop).
        self.heap_trimmer.release_later(chars)
        refuse_unfitting(request, self.tokenizer, self.max_model_len)
        prepared = await self.tokenizer_pool.run(prepare, request, self.tokenizer, self.model_name, self.max_model_len,
                                                 request_id, self.backend.serves_lora, chars=max(chars, INLINE_CHARS) if constrained else chars)
        prepared.tenant = tenant
        usage = common_pb2.Usage(prompt_tokens=len(prepared.prompt_token_ids))
        timer.adapter, timer.tenant = prepared.adapter, tenant
        n = prepared.sampling.n
        finish, backend = NOT_FINISHED, ""
        scoped = prepared.scoped_id
        self.active.register(scoped, [scoped])
        try:  # aclosing: closing this generator closes the backend's stream at once (ends the request downstream)
            calls = {i: ToolCallStream(tools) for i in range(n)} if tools else {}
            async with aclosing(self._stream(request, prepared, timeout, timer, usage, calls)) as responses:
                async for response in responses:
                    finish, backend = response.finish_reason, response.backend
                    yield response
        finally:
            self.active.unregister(scoped, [scoped])
        log.info("finished", backend=backend, finish_reason=finish_reason_name(finish), prompt_tokens=usage.prompt_tokens,
                 completion_tokens=usage.completion_tokens, n=n, seconds=round(time.perf_counter() - started, 3))

    async def _stream(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest, timeout: float | None,
                      timer: RequestTimer, usage: common_pb2.Usage,
                      calls: dict[int, ToolCallStream]) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """`calls`: per sample, when the answer may hold tool calls: they are taken out of the text."""
        running = set(range(prepared.sampling.n))
        scoped = prepared.scoped_id  # once, not per message (a new string with a tenant)
        # aclosing: leaving the loop early closes the backend's stream at once, which ends the
        # request downstream.
        async with aclosing(self.backend.generate(request, prepared, timeout)) as outputs:
            async for output in outputs:
                response = output.response
                if response.index in calls:
                    calls[response.index].apply(response)
                usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, output.cached_prompt_tokens)
                usage.completion_tokens += output.generated_tokens
                usage.speculative_draft_tokens += output.draft_tokens
                usage.speculative_accepted_tokens += output.accepted_draft_tokens
                timer.on_tokens(output.generated_tokens, output.queue_seconds)
                if is_finished(response.finish_reason):
                    running.discard(response.index)
                    if not running:
                        self._close_usage(response, usage, timer)
                yield response
                if not running:
                    return
                if scoped in self.active.aborted:
                    break  # an Abort that landed before the backend knew the request: end it here
        if running and scoped in self.active.aborted:  # closing the backend's stream ended it downstream
            for index in sorted(running):
                response = inference_pb2.GenerateResponse(request_id=prepared.request_id,
                                                          model=prepared.adapter or self.model_name,
                                                          index=index, finish_reason=common_pb2.FINISH_REASON_ABORT)
                if index == max(running):
                    self._close_usage(response, usage, timer)
                yield response

    @staticmethod
    def _close_usage(response: inference_pb2.GenerateResponse, usage: common_pb2.Usage, timer: RequestTimer) -> None:
        """The request's last message carries its usage."""
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        response.usage.CopyFrom(usage)
        timer.finish(response.finish_reason, usage)

    async def abort(self, client_ids: list[str]) -> tuple[list[str], list[str]]:
        """Abort the caller's requests by client id: (aborted, not_found). Ids this gateway does not know
        are tried on the backend (the request may have come through another gateway replica). A key
        reaches only its own tenant's requests (hetero_common/tenancy.py); an admin key with keys on,
        every tenant's request of that id."""
        principal = current_principal()
        every_tenant = principal.admin and bool(principal.tenant)
        aborted: list[str] = []
        not_found: list[str] = []
        for cid in dict.fromkeys(client_ids):
            own = scoped_id(principal.tenant, cid)
            local = self.active.lookup_any_tenant(cid, client_id) if every_tenant else self.active.lookup(own)
            self.active.mark_aborted(local)  # before any await: the ids are still registered
            calls = [self.backend.abort(i) for i in local] if local else [self.backend.abort(cid, any_tenant=True)
                                                                          if every_tenant else self.backend.abort(own)]
            found = await asyncio.gather(*calls, return_exceptions=True)
            errors = [f for f in found if isinstance(f, BaseException)]
            if errors and not local and not any(f is True for f in found):
                raise errors[0]  # e.g. the scheduler unreachable: whether the id is in flight there is unknown
            (aborted if local or any(f is True for f in found) else not_found).append(cid)
        log.info("abort", aborted=aborted, not_found=not_found, **({"tenant": principal.tenant} if principal.tenant else {}))
        return aborted, not_found

    # --- LoRA adapters: loading, unloading and their paths are an admin's (docs/security.md) ---

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        require_admin("replacing a LoRA adapter" if request.replace else "loading a LoRA adapter")
        return await self.backend.load_lora_adapter(request, timeout)

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        require_admin("unloading a LoRA adapter")
        return await self.backend.unload_lora_adapter(request, timeout)

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        """The adapters loaded now; their paths (the server's filesystem) only for an admin."""
        adapters = await self.backend.lora_adapters()
        if current_principal().admin:
            return adapters
        return [common_pb2.LoraAdapter(name=a.name, rank=a.rank, target_modules=a.target_modules, slot=a.slot,
                                       active_requests=a.active_requests) for a in adapters]

    async def check_model(self, requested: str) -> None:
        """`requested` (Tokenize's and Detokenize's `model`) is empty, the served model or a loaded LoRA adapter."""
        if requested and requested != self.model_name:
            check_model(requested, self.model_name, [a.name for a in await self.backend.lora_adapters()])
