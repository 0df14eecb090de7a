"""The public `hetero.v1.Inference` gRPC API: thin adapters over the generation path.

Errors become gRPC statuses here (`end_call`: the status is set and the handler returns, never
raises, so that nothing keeps a refused request alive), in one place: each handler is wrapped in
`answers_errors`. Everything else is `Generation`'s.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import structlog

from gateway.embedding import Embeddings
from gateway.generation import Generation
from gateway.text import tokenization
from gateway.validation import request_id_problem
from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_common import __version__
from hetero_common.config import EmbeddingConfig
from hetero_common.errors import HeteroError, ValidationError
from hetero_common.finish_reasons import is_finished
from hetero_common.grpc_server import end_call, error_status

log = structlog.get_logger("gateway.grpc.grpc_api")
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
MAX_ABORT_IDS = 1024  # request ids per Abort call


def add_inference_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """The generated `add_InferenceServicer_to_server`, but for Tokenize: its answer comes serialized
    (`InferenceServicer.Tokenize`), and is sent as it is (`sent_as_serialized`)."""
    table = _HandlerTable()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, table)
    handlers = {**table.handlers, "Tokenize": grpc.unary_unary_rpc_method_handler(
        servicer.Tokenize, request_deserializer=inference_pb2.TokenizeRequest.FromString,
        response_serializer=sent_as_serialized)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def sent_as_serialized(answer: bytes) -> bytes:
    """Tokenize's response serializer, which grpc.aio runs on the event loop: nothing left to do there."""
    return answer


class _HandlerTable:
    """What the generated registration gives a server: its method handlers, to register amended."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers as add_registered_method_handlers's, in another form

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


Context = grpc.aio.ServicerContext
UnaryHandler = Callable[[Any, Any, Context], Awaitable[Any]]
StreamHandler = Callable[[Any, Any, Context], AsyncIterator[Any]]


def _failed(context: Context, error: HeteroError, request_scoped: bool) -> None:
    if request_scoped:  # a generation or embedding request's failure is logged; the small calls' are not
        log.info("request failed", error=error.message, code=error_status(error)[0].name)
    end_call(context, error)


def answers_errors(empty: Callable[[], Any] | None = None, *,
                   request_scoped: bool = False) -> Callable[[Any], Any]:
    """Wrap a handler so that a HeteroError it raises ends the call with its status (`end_call`)
    and the handler returns instead of raising: a unary handler (a coroutine function) with
    `empty()`, which grpc discards under the non-OK status; a server-streaming one (a function
    returning an async iterator) after the messages already sent.

    `request_scoped`: a handler serving one request that `Generation` or `Embeddings` bound to
    the log context; its failure is logged, and the request id unbound when it ends."""

    def unbind() -> None:
        if request_scoped:
            structlog.contextvars.unbind_contextvars("request_id")

    def unary(handler: UnaryHandler) -> UnaryHandler:
        assert empty is not None, f"{handler.__name__}: a unary handler needs its empty answer"

        @functools.wraps(handler)
        async def answer(self: Any, request: Any, context: Context) -> Any:
            try:
                return await handler(self, request, context)
            except HeteroError as exc:
                _failed(context, exc, request_scoped)
                return empty()
            except Exception as exc:  # a bug: a generic answer, the detail logged (grpc_server.error_status)
                end_call(context, exc)
                return empty()
            finally:
                unbind()
        return answer

    def stream(handler: StreamHandler) -> StreamHandler:
        @functools.wraps(handler)
        async def messages(self: Any, request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for message in handler(self, request, context):
                    yield message
            except HeteroError as exc:
                _failed(context, exc, request_scoped)
            except Exception as exc:  # a bug: a generic answer, the detail logged (grpc_server.error_status)
                end_call(context, exc)
            finally:
                unbind()
        return messages

    def decorate(handler: Any) -> Any:
        return unary(handler) if inspect.iscoroutinefunction(handler) else stream(handler)
    return decorate


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, generation: Generation, embeddings: Embeddings | None = None) -> None:
        self.generation = generation
        self.embeddings = embeddings or Embeddings(EmbeddingConfig(), generation, None)

    @answers_errors(inference_pb2.EmbedResponse, request_scoped=True)
    async def Embed(self, request: inference_pb2.EmbedRequest, context: Context) -> inference_pb2.EmbedResponse:
        return await self.embeddings.embed(request, context.time_remaining())

    @answers_errors(request_scoped=True)
    def Generate(self, request: inference_pb2.GenerateRequest,
                 context: Context) -> AsyncIterator[inference_pb2.GenerateResponse]:
        return self.generation.generate(request, context.time_remaining())

    @answers_errors(inference_pb2.GenerateResponse, request_scoped=True)
    async def Complete(self, request: inference_pb2.GenerateRequest,
                       context: Context) -> inference_pb2.GenerateResponse:
        """The whole answer at once. With n > 1 the top-level fields are sample 0 and `choices`
        holds every sample (index 0..n-1); `usage` counts all samples."""
        answers: dict[int, inference_pb2.GenerateResponse] = {}
        usage = common_pb2.Usage()
        async for part in self.generation.generate(request, context.time_remaining()):
            answer = answers.setdefault(part.index, inference_pb2.GenerateResponse(index=part.index))
            answer.request_id, answer.model, answer.backend = part.request_id, part.model, part.backend
            answer.text += part.text
            answer.token_ids.extend(part.token_ids)
            answer.token_timestamps.extend(part.token_timestamps)
            answer.logprobs.extend(part.logprobs)
            answer.top_logprobs.extend(part.top_logprobs)
            answer.prompt_logprobs.extend(part.prompt_logprobs)  # first message only
            answer.prompt_top_logprobs.extend(part.prompt_top_logprobs)
            answer.tool_calls.extend(part.tool_calls)  # last message only
            if is_finished(part.finish_reason):
                answer.finish_reason, answer.stop_reason = part.finish_reason, part.stop_reason
            if part.HasField("usage"):
                usage.CopyFrom(part.usage)
        result = inference_pb2.GenerateResponse()
        if answers:
            result.CopyFrom(answers[min(answers)])
        result.usage.CopyFrom(usage)
        if len(answers) > 1:
            for index in sorted(answers):
                result.choices.append(answers[index])
        return result

    @answers_errors(bytes)
    async def Tokenize(self, request: inference_pb2.TokenizeRequest, context: Context) -> bytes:
        """The answer serialized already, off the loop when large (`tokenization.tokenize_answer`): register
        the servicer with `add_inference_servicer`, whose Tokenize sends these bytes as they are."""
        g = self.generation
        await g.check_model(request.model)
        return await g.tokenizer_pool.run(tokenization.tokenize_answer, g.tokenizer, request, g.max_model_len,
                                          chars=tokenization.tokenize_request_chars(request))

    @answers_errors(inference_pb2.DetokenizeResponse)
    async def Detokenize(self, request: inference_pb2.DetokenizeRequest,
                         context: Context) -> inference_pb2.DetokenizeResponse:
        await self.generation.check_model(request.model)
        text = tokenization.detokenize(self.generation.tokenizer, list(request.token_ids),
                                       request.include_special_tokens, param="token_ids")
        return inference_pb2.DetokenizeResponse(text=text)

    @answers_errors(inference_pb2.AbortGenerationResponse)
    async def Abort(self, request: inference_pb2.AbortGenerationRequest,
                    context: Context) -> inference_pb2.AbortGenerationResponse:
        """End requests by id from any connection; each stream's last message has FINISH_REASON_ABORT."""
        if len(request.request_ids) > MAX_ABORT_IDS:
            raise ValidationError(f"request_ids has {len(request.request_ids)} ids; at most {MAX_ABORT_IDS} per call")
        ids = list(request.request_ids)
        valid = [i for i in ids if i and request_id_problem(i) is None]
        aborted, not_found = await self.generation.abort(valid)
        invalid = [i for i in dict.fromkeys(ids) if i not in valid]  # an id no request can have names none
        return inference_pb2.AbortGenerationResponse(aborted=aborted, not_found=not_found + invalid)

    @answers_errors(inference_pb2.ListModelsResponse)
    async def ListModels(self, request: inference_pb2.ListModelsRequest,
                         context: Context) -> inference_pb2.ListModelsResponse:
        g = self.generation
        t = g.tokenizer
        card = inference_pb2.ModelCard(id=g.model_name, max_model_len=g.max_model_len, vocab_size=t.vocab_size,
                                       has_chat_template=bool(t.chat_template), eos_token_ids=list(t.eos_token_ids))
        card.MergeFrom(await g.model_facts())
        if t.bos_token_id is not None:
            card.bos_token_id = t.bos_token_id
        cards = [card]
        for adapter in await g.backend.lora_adapters():  # each LoRA adapter: the base model's card under its name
            cards.append(inference_pb2.ModelCard())
            cards[-1].CopyFrom(card)
            cards[-1].id = adapter.name
        return inference_pb2.ListModelsResponse(models=cards)

    @answers_errors(common_pb2.LoraAdapter)
    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: Context) -> common_pb2.LoraAdapter:
        return await self.generation.load_lora_adapter(request, context.time_remaining())

    @answers_errors(common_pb2.UnloadLoraAdapterResponse)
    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: Context) -> common_pb2.UnloadLoraAdapterResponse:
        return await self.generation.unload_lora_adapter(request, context.time_remaining())

    @answers_errors(common_pb2.ListLoraAdaptersResponse)
    async def ListLoraAdapters(self, request: common_pb2.ListLoraAdaptersRequest,
                               context: Context) -> common_pb2.ListLoraAdaptersResponse:
        return common_pb2.ListLoraAdaptersResponse(adapters=await self.generation.lora_adapters())

    @answers_errors(inference_pb2.ServerInfo)
    async def GetServerInfo(self, request: inference_pb2.GetServerInfoRequest,
                            context: Context) -> inference_pb2.ServerInfo:
        info = await self.generation.backend.server_info()
        info.version, info.model = __version__, self.generation.model_name
        return info
