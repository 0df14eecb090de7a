"""A backend that answers with a second one when the first is unavailable (serving.backend.fallback).

Only a request the primary could not start falls back: once a message has gone to the
client, switching backends would stream a second, different answer after the first.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

import structlog

from gateway.backends.backend import Backend, EmbeddingCall, EmbeddingOutput, SampleOutput
from gateway.validation import PreparedRequest
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import UnavailableError

log = structlog.get_logger("gateway.backends.fallback")


class FallbackBackend:
    def __init__(self, primary: Backend, fallback: Backend) -> None:
        self.primary = primary
        self.fallback = fallback
        self.serves_lora = primary.serves_lora  # adapters are the primary's; the bridge refuses them

    def stop(self) -> None:
        self.primary.stop()
        self.fallback.stop()

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        try:
            return await self.primary.lora_adapters()
        except UnavailableError:  # the bridge answers for now, and it serves none
            return await self.fallback.lora_adapters()

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        return await self.primary.load_lora_adapter(request, timeout)

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        return await self.primary.unload_lora_adapter(request, timeout)

    async def embed(self, call: EmbeddingCall, timeout: float | None) -> EmbeddingOutput:
        return await self.primary.embed(call, timeout)  # the bridge computes no vectors

    async def max_model_len(self) -> int | None:
        return await self.primary.max_model_len()

    async def server_info(self) -> inference_pb2.ServerInfo:
        return await self.primary.server_info()

    async def model_facts(self) -> inference_pb2.ModelCard:
        return await self.primary.model_facts()

    async def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        """The bridge first: a request it answers is there because the scheduler was unreachable."""
        return (await self.fallback.abort(request_id, any_tenant)
                or await self.primary.abort(request_id, any_tenant))

    async def generate(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                       timeout: float | None) -> AsyncIterator[SampleOutput]:
        received = False
        try:
            async with aclosing(self.primary.generate(request, prepared, timeout)) as outputs:
                async for output in outputs:
                    received = True
                    yield output
            return
        except UnavailableError as exc:  # the primary's retries are spent
            if received:
                raise
            log.warning("scheduler unavailable after retries; answering with the command bridge", error=exc.message)
        async with aclosing(self.fallback.generate(request, prepared, timeout)) as outputs:
            async for output in outputs:
                yield output
