"""The public `hetero.v1.Inference` gRPC API: thin adapters over the generation path.

Errors become gRPC statuses here (`end_call`: the status is set and the handler returns, never
raises, so that nothing keeps a refused request alive); everything else is `Generation`'s.
"""

from __future__ import annotations

import grpc
import structlog

from gateway.embedding import Embeddings
from gateway.generation import Generation
from gateway.text import tokenization
from gateway.validation import MAX_REQUEST_ID_LEN
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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, generation: Generation, embeddings: Embeddings | None = None) -> None:
        self.generation = generation
        self.embeddings = embeddings or Embeddings(EmbeddingConfig(), generation, None)

    async def Embed(self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> inference_pb2.EmbedResponse:
        try:
            return await self.embeddings.embed(request, context.time_remaining())
        except HeteroError as exc:
            log.info("request failed", error=exc.message, code=error_status(exc)[0].name)
            end_call(context, exc)
            return inference_pb2.EmbedResponse()
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self.generation.generate(request, context.time_remaining()):
                yield response
        except HeteroError as exc:
            log.info("request failed", error=exc.message, code=error_status(exc)[0].name)
            end_call(context, exc)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def Complete(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> inference_pb2.GenerateResponse:
        """The whole answer at once. With n > 1 the top-level fields are sample 0 and `choices`
        holds every sample (index 0..n-1); `usage` counts all samples."""
        answers: dict[int, inference_pb2.GenerateResponse] = {}
        usage = common_pb2.Usage()
        try:
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
        except HeteroError as exc:
            log.info("request failed", error=exc.message)
            end_call(context, exc)
            return inference_pb2.GenerateResponse()
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

    async def Tokenize(self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> bytes:
        """The answer serialized already, off the loop when large (`tokenization.tokenize_answer`): register
        the servicer with `add_inference_servicer`, whose Tokenize sends these bytes as they are."""
        g = self.generation
        try:
            await g.check_model(request.model)
            return await g.tokenizer_pool.run(tokenization.tokenize_answer, g.tokenizer, request, g.max_model_len,
                                              chars=tokenization.tokenize_request_chars(request))
        except HeteroError as exc:
            end_call(context, exc)
            return b""

    async def Detokenize(self, request: inference_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.DetokenizeResponse:
        try:
            await self.generation.check_model(request.model)
            text = tokenization.detokenize(self.generation.tokenizer, list(request.token_ids),
                                           request.include_special_tokens, param="token_ids")
        except HeteroError as exc:
            end_call(context, exc)
            return inference_pb2.DetokenizeResponse()
        return inference_pb2.DetokenizeResponse(text=text)

    async def Abort(self, request: inference_pb2.AbortGenerationRequest,
                    context: grpc.aio.ServicerContext) -> inference_pb2.AbortGenerationResponse:
        """End requests by id from any connection; each stream's last message has FINISH_REASON_ABORT."""
        try:
            if len(request.request_ids) > MAX_ABORT_IDS:
                raise ValidationError(f"request_ids has {len(request.request_ids)} ids; at most {MAX_ABORT_IDS} per call")
            ids = list(request.request_ids)
            valid = [i for i in ids if i and len(i) <= MAX_REQUEST_ID_LEN]
            aborted, not_found = await self.generation.abort(valid)
        except HeteroError as exc:
            end_call(context, exc)
            return inference_pb2.AbortGenerationResponse()
        invalid = [i for i in dict.fromkeys(ids) if i not in valid]  # an empty or over-long id names no request
        return inference_pb2.AbortGenerationResponse(aborted=aborted, not_found=not_found + invalid)

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        g = self.generation
        t = g.tokenizer
        card = inference_pb2.ModelCard(id=g.model_name, max_model_len=g.max_model_len, vocab_size=t.vocab_size,
                                       has_chat_template=bool(t.chat_template), eos_token_ids=list(t.eos_token_ids))
        if t.bos_token_id is not None:
            card.bos_token_id = t.bos_token_id
        cards = [card]
        try:
            adapters = await g.backend.lora_adapters()
        except HeteroError as exc:
            end_call(context, exc)
            return inference_pb2.ListModelsResponse()
        for adapter in adapters:  # each LoRA adapter: the base model's card under its name
            cards.append(inference_pb2.ModelCard())
            cards[-1].CopyFrom(card)
            cards[-1].id = adapter.name
        return inference_pb2.ListModelsResponse(models=cards)

    async def LoadLoraAdapter(self, request: common_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoraAdapter:
        try:
            return await self.generation.backend.load_lora_adapter(request, context.time_remaining())
        except HeteroError as exc:
            end_call(context, exc)
            return common_pb2.LoraAdapter()

    async def UnloadLoraAdapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoraAdapterResponse:
        try:
            return await self.generation.backend.unload_lora_adapter(request, context.time_remaining())
        except HeteroError as exc:
            end_call(context, exc)
            return common_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request: common_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.ListLoraAdaptersResponse:
        try:
            return common_pb2.ListLoraAdaptersResponse(adapters=await self.generation.backend.lora_adapters())
        except HeteroError as exc:
            end_call(context, exc)
            return common_pb2.ListLoraAdaptersResponse()

    async def GetServerInfo(self, request: inference_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> inference_pb2.ServerInfo:
        try:
            info = await self.generation.backend.server_info()
        except HeteroError as exc:
            end_call(context, exc)
            return inference_pb2.ServerInfo()
        info.version, info.model = __version__, self.generation.model_name
        return info
