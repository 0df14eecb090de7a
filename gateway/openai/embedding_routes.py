"""POST /v1/embeddings with OpenAI's request and response shapes (docs/embeddings.md): `input` as a string, a
list of strings, a list of token ids or a list of lists of them; `dimensions`, `encoding_format` (float or
base64: the official client asks for base64 and decodes it) and `user`. Three fields of our own, as vLLM has
them: `pooling`, `normalize` and `priority`. Any other field is refused with a 400 naming it (StrictBody)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Request
from pydantic import Field, field_validator

from gateway.embedding import Embeddings
from gateway.openai.bodies import UINT32_MAX, StrictBody, check_prompt_form
from gateway.openai.request_id import request_id as client_request_id
from hetero.v1 import inference_pb2
from hetero_common.embedding_vectors import POOLING_BY_NAME


class EmbeddingBody(StrictBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=UINT32_MAX, description="keep the first N values (Matryoshka)")
    user: str | None = Field(None, max_length=256, description="recorded in the log line, not used otherwise")
    pooling: Literal["last", "mean", "cls"] | None = Field(None, description="default: the model's")
    normalize: bool = Field(True, description="L2-normalise each vector (after `dimensions`)")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower is admitted first (vLLM's convention)")

    @field_validator("input", mode="before")
    @classmethod
    def _input_form(cls, value: Any) -> Any:
        return check_prompt_form(value, "input")

    def to_request(self, request_id: str) -> inference_pb2.EmbedRequest:
        request = inference_pb2.EmbedRequest(
            request_id=request_id, model=self.model or "", dimensions=self.dimensions or 0, normalize=self.normalize,
            priority=self.priority, pooling=POOLING_BY_NAME[self.pooling] if self.pooling else 0,
            encoding_format=(inference_pb2.EMBEDDING_ENCODING_BASE64 if self.encoding_format == "base64"
                             else inference_pb2.EMBEDDING_ENCODING_FLOAT))
        items = self.input
        if isinstance(items, str):
            request.inputs.add(text=items)
        elif items and all(type(i) is int for i in items):
            request.inputs.add().token_ids.ids.extend(items)  # type: ignore[arg-type]
        else:
            for item in items:
                if isinstance(item, str):
                    request.inputs.add(text=item)
                else:
                    request.inputs.add().token_ids.ids.extend(item)  # type: ignore[arg-type]
        return request


class EmbeddingRoutes:
    def __init__(self, embeddings: Embeddings) -> None:
        self.embeddings = embeddings

    async def create(self, body: EmbeddingBody, request: Request) -> dict[str, Any]:
        request_id = client_request_id(request.scope)  # X-Request-Id, or the one RequestIdMiddleware made
        answer = await self.embeddings.embed(body.to_request(request_id), client_request_id=request_id)
        base64 = body.encoding_format == "base64"
        data = [{"object": "embedding", "index": item.index,
                 "embedding": item.base64 if base64 else list(item.values)} for item in answer.data]
        return {"object": "list", "data": data, "model": answer.model,
                "usage": {"prompt_tokens": answer.usage.prompt_tokens, "total_tokens": answer.usage.total_tokens}}
