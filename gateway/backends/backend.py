"""The backend interface: what answers a validated request, in text, one sample's message at a time.

Two backends implement it: the scheduler (`scheduler_backend.py`, token ids detokenized in
the gateway) and the command bridge (`command_bridge.py`, a program that answers in text);
`fallback.py` chains them. The generation path (`generation.py`) sees only this interface:
it meters, counts usage and ends the request, whichever backend answers.
"""

from __future__ import annotations

from collections.abc import Sequence as ListLike
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from gateway.validation import PreparedRequest
from hetero.v1 import common_pb2, inference_pb2


@dataclass
class SampleOutput:
    """One client message of one sample (`response.index`), plus what it adds to usage and metrics.

    The sample's last message carries its `finish_reason`; a backend yields nothing for a
    sample after that."""

    response: inference_pb2.GenerateResponse
    generated_tokens: int = 0  # tokens this message accounts for
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (the request's, not a sum)
    queue_seconds: float = 0.0  # scheduler arrival to first admission; read with the first tokens
    draft_tokens: int = 0  # speculative drafts proposed for this message's tokens
    accepted_draft_tokens: int = 0  # of those, kept


@dataclass
class EmbeddingCall:
    """One input of an embedding request, tokenized (gateway/embedding.py)."""

    request_id: str
    prompt_token_ids: list[int]
    pooling: int  # common_pb2.Pooling, resolved (never UNSPECIFIED)
    priority: int = 0
    adapter: str = ""  # the LoRA adapter `model` named ("" = the base model)


@dataclass
class EmbeddingOutput:
    values: ListLike[float]  # pooled, not normalised
    queue_seconds: float = 0.0


class Backend(Protocol):
    # Requests may name LoRA adapters (`model`); the backend says which exist, and refuses the others.
    serves_lora: bool

    async def max_model_len(self) -> int | None:
        """The served model's context length, when the backend knows it (asked once, at start)."""
        ...

    async def server_info(self) -> inference_pb2.ServerInfo:
        """The backend's part of GetServerInfo (the caller adds version and model)."""
        ...

    async def model_facts(self) -> inference_pb2.ModelCard:
        """The served model's architecture, and for a mixture of experts its experts and experts per token, as
        far as the backend knows them (an empty card where it does not: no worker yet, or a program's model)."""
        ...

    def generate(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                 timeout: float | None) -> AsyncIterator[SampleOutput]:
        """Every sample's messages (interleaved when n > 1) until each has finished. `timeout` is
        the client's remaining time. Closing the iterator early ends the request downstream."""
        ...

    async def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        """End a request in flight by its scoped id (`PreparedRequest.scoped_id`); its stream's last
        message then has finish_reason ABORT. False when the backend has no such request.
        `any_tenant` (an admin's abort): `request_id` is a client id, ended in every tenant's namespace."""
        ...

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        """The LoRA adapters loaded now (none for a backend that serves none)."""
        ...

    def stop(self) -> None:
        """The gateway has stopped (its drain's grace is over): end what still runs for it."""
        ...

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        ...

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        """Answers once the requests using the adapter have finished (new ones are refused at once)."""
        ...

    async def embed(self, call: EmbeddingCall, timeout: float | None) -> EmbeddingOutput:
        """The input's pooled vector (raises UnsupportedError where the backend computes none)."""
        ...
