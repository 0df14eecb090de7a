"""LoRA adapters at run time over HTTP, as vLLM names the routes (issue 41; docs/lora.md):
POST /v1/load_lora_adapter {lora_name, lora_path, replace}, POST /v1/unload_lora_adapter {lora_name},
and GET /v1/lora_adapters (what is loaded, with the requests using each). Behind the API-key check like every
other route, and with no environment flag to turn them on; loading and unloading need an admin key, and only an
admin key sees the adapters' paths (`Generation.load_lora_adapter`, docs/security.md). The answers are the gRPC service's, as JSON."""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict
from pydantic import Field

from gateway.generation import Generation
from gateway.openai.bodies import StrictBody
from hetero.v1 import common_pb2


class LoadLoraAdapterBody(StrictBody):
    lora_name: str = Field(description="how requests name it (their `model`)")
    lora_path: str = Field(description="its directory on the server, in PEFT's format")
    replace: bool = Field(False, description="load over an adapter of the same name")


class UnloadLoraAdapterBody(StrictBody):
    lora_name: str


def _json(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class LoraRoutes:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def load(self, body: LoadLoraAdapterBody) -> dict[str, Any]:
        request = common_pb2.LoadLoraAdapterRequest(name=body.lora_name, path=body.lora_path, replace=body.replace)
        return _json(await self.generation.load_lora_adapter(request, None))

    async def unload(self, body: UnloadLoraAdapterBody) -> dict[str, Any]:
        request = common_pb2.UnloadLoraAdapterRequest(name=body.lora_name)
        return _json(await self.generation.unload_lora_adapter(request, None))

    async def adapters(self) -> dict[str, Any]:
        return {"object": "list", "data": [_json(a) for a in await self.generation.lora_adapters()]}
