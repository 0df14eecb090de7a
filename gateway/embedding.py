"""The embedding path, shared by gRPC (`Embed`) and HTTP (`/v1/embeddings`): checked and tokenized
(embedding_inputs.py), each input sent downstream as its own prefill-only request (`<request_id>-<i>`, all at
once, so the scheduler batches them with whatever else runs), the pooled vectors made into what the request
asked (hetero_common/embedding_vectors.py), metered, and registered for `Abort` like a generation.

It shares the generation path's concurrency limit, tokenizer threads and registry of requests in flight
(`Generation`): an embedding request counts as one request in flight, whatever its inputs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import structlog

from gateway.auth import current_principal
from gateway.backends.backend import EmbeddingCall, EmbeddingOutput
from gateway.embedding_inputs import EmbeddingLimits, check_request, input_chars, tokenize_inputs
from gateway.generation import Generation
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import EmbeddingConfig
from hetero_common.embedding_vectors import POOLING_NAMES, default_pooling, finish_vector, to_base64
from hetero_common.errors import HeteroError
from hetero_common.tenancy import scoped_id

log = structlog.get_logger("gateway.embedding")
# Inputs of one request submitted at once: enough to fill the engine's steps, few enough that a request of
# serving.embedding.max_inputs (2048 by default) never fills the scheduler's queue (max_queued_requests) alone.
INPUTS_IN_FLIGHT = 256


class Embeddings:
    def __init__(self, config: EmbeddingConfig, generation: Generation, model_path: Path | None) -> None:
        """`config`: serving.embedding; `model_path`: the served model's directory (its pooling config), if any."""
        self.generation = generation
        self.default_pooling = default_pooling(config.pooling, model_path)
        self.max_inputs = config.max_inputs
        self.hidden_size: int | None = None  # learned from the first vector: `dimensions` is checked before computing then

    def limits(self) -> EmbeddingLimits:
        gen = self.generation
        return EmbeddingLimits(gen.model_name, gen.max_model_len, self.max_inputs, self.hidden_size,
                               gen.backend.serves_lora)

    async def embed(self, request: inference_pb2.EmbedRequest, timeout: float | None = None,
                    client_request_id: str | None = None) -> inference_pb2.EmbedResponse:
        """One vector per input, in input order; `timeout`: the client's remaining time."""
        gen = self.generation
        if client_request_id is not None and client_request_id != request.request_id:
            structlog.contextvars.bind_contextvars(client_request_id=client_request_id)
        with gen.request_slot():
            try:
                return await self._embed(request, timeout)
            except HeteroError as exc:
                gen.metrics.request_errors.labels(type(exc).__name__).inc()
                raise

    async def _embed(self, request: inference_pb2.EmbedRequest, timeout: float | None) -> inference_pb2.EmbedResponse:
        gen = self.generation
        request_id = request.request_id or f"emb-{uuid.uuid4().hex[:16]}"
        tenant = current_principal().tenant  # the inputs' ids live in the caller's namespace (tenancy.py)
        structlog.contextvars.bind_contextvars(request_id=request_id, **({"tenant": tenant} if tenant else {}))
        started = time.perf_counter()
        limits = self.limits()
        adapter = check_request(request, limits)
        chars = input_chars(request)
        gen.heap_trimmer.release_later(chars)
        inputs = await gen.tokenizer_pool.run(tokenize_inputs, request, gen.tokenizer, limits.max_model_len, chars=chars)
        pooling = request.pooling or self.default_pooling
        calls = [EmbeddingCall(scoped_id(tenant, f"{request_id}-{i}"), ids, pooling, request.priority, adapter)
                 for i, ids in enumerate(inputs)]
        ids = [call.request_id for call in calls]
        scoped = scoped_id(tenant, request_id)
        gen.active.register(scoped, ids)
        try:
            window = asyncio.Semaphore(INPUTS_IN_FLIGHT)
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout

            async def embed_one(call: EmbeddingCall) -> EmbeddingOutput:
                async with window:  # an input that waited here has that much less of the client's time
                    left = None if deadline is None else max(0.001, deadline - loop.time())
                    return await gen.backend.embed(call, left)

            async with asyncio.TaskGroup() as group:  # one input failing cancels the others (their blocks freed)
                tasks = [group.create_task(embed_one(call)) for call in calls]
        except BaseExceptionGroup as group:  # the first typed error is the request's answer
            raise next((e for e in group.exceptions if isinstance(e, HeteroError)), group.exceptions[0]) from None
        finally:
            gen.active.unregister(scoped, ids)
        outputs = [task.result() for task in tasks]
        response = self._response(request, request_id, adapter, inputs, outputs)
        self._meter(response, outputs, time.perf_counter() - started)
        log.info("embedded", inputs=len(inputs), pooling=POOLING_NAMES[pooling], prompt_tokens=response.usage.prompt_tokens,
                 seconds=round(time.perf_counter() - started, 3))
        return response

    def _response(self, request: inference_pb2.EmbedRequest, request_id: str, adapter: str, inputs: list[list[int]],
                  outputs: list[EmbeddingOutput]) -> inference_pb2.EmbedResponse:
        normalize = request.normalize if request.HasField("normalize") else True
        base64 = request.encoding_format == inference_pb2.EMBEDDING_ENCODING_BASE64
        response = inference_pb2.EmbedResponse(request_id=request_id, model=adapter or self.generation.model_name)
        self.hidden_size = len(outputs[0].values)
        for index, (ids, output) in enumerate(zip(inputs, outputs)):
            vector = finish_vector(output.values, request.dimensions, normalize)  # dimensions checked here at the latest
            item = response.data.add(index=index, prompt_tokens=len(ids))
            if base64:
                item.base64 = to_base64(vector)
            else:
                item.values.extend(vector.tolist())
        tokens = sum(map(len, inputs))
        response.usage.CopyFrom(common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens))
        return response

    def _meter(self, response: inference_pb2.EmbedResponse, outputs: list[EmbeddingOutput], seconds: float) -> None:
        metrics = self.generation.metrics
        metrics.embedding_requests.inc()
        metrics.embedding_inputs.inc(len(response.data))
        metrics.embedding_tokens.inc(response.usage.prompt_tokens)
        metrics.embedding_latency.observe(seconds)
        for output in outputs:
            metrics.queue.observe(output.queue_seconds)
