"""One timed request against the gateway, over gRPC (Generate stream) or HTTP (SSE /v1/completions).

Times are taken on receipt, client side: what a user of the API experiences.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass, field

import grpc
import httpx

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_infer.bench.dataset import BenchRequest
from hetero_infer.bench.stats import time_per_output_token


@dataclass
class RequestRecord:
    start: float  # seconds since the run began
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # receipt time of each message carrying text
    end: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        # Up to the end of the response (the message that finishes it), not the last text chunk's receipt.
        if self.output_tokens < 2:
            return None
        return time_per_output_token(self.chunk_times[0], self.end, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class GrpcClient:
    def __init__(self, address: str, api_key: str | None, model: str, tls_ca: str | None = None) -> None:
        creds = grpc.ssl_channel_credentials(open(tls_ca, "rb").read()) if tls_ca else None
        self.channel = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.model = model

    async def run(self, req: BenchRequest, t0: float) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter() - t0)
        params = common_pb2.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for msg in self.stub.Generate(inference_pb2.GenerateRequest(model=self.model, prompt=req.prompt,
                                                                              params=params), metadata=self.metadata):
                if msg.token_ids:
                    record.chunk_times.append(time.perf_counter() - t0)
                record.output_tokens += len(msg.token_ids)
                if msg.finish_reason:
                    record.prompt_tokens = msg.usage.prompt_tokens
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        record.end = time.perf_counter() - t0
        return record

    async def close(self) -> None:
        await self.channel.close()


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None, model: str, tls_ca: str | None = None) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        verify = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=None, verify=verify,
                                        limits=httpx.Limits(max_connections=None))
        self.model = model

    async def run(self, req: BenchRequest, t0: float) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter() - t0)
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            record.error = data["error"]["message"]
                        elif data.get("usage"):
                            record.prompt_tokens = data["usage"]["prompt_tokens"]
                            record.output_tokens = data["usage"]["completion_tokens"]
                        elif data["choices"] and data["choices"][0].get("text"):
                            record.chunk_times.append(time.perf_counter() - t0)
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter() - t0
        return record

    async def close(self) -> None:
        await self.client.aclose()
