"""Issue 58 (rows 5, 7, 8), fast: a completion's prompts are capped and run a window at a time; request
ids hold printable ASCII only (gRPC, embeddings, Abort, X-Request-Id); a body or schema nested too deeply
is a 400 / INVALID_ARGUMENT, never a RecursionError; an unexpected error is answered with the request id
only, its details logged. The gateway's real app and gRPC servicer over the command bridge (`echo`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import grpc
import pytest
from fastapi.testclient import TestClient
from structlog.testing import capture_logs

from gateway.auth import ApiKeys
from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.embedding_inputs import EmbeddingLimits, check_request
from gateway.generation import Generation
from gateway.grpc.grpc_api import InferenceServicer, add_inference_servicer
from gateway.limits.active_requests import ActiveRequests
from gateway.openai import streams
from gateway.openai.app import HttpApi, error_body
from gateway.openai.json_body import MAX_NESTING
from gateway.openai.request_id import RequestIdMiddleware
from gateway.validation import MAX_REQUEST_ID_LEN, check_request_id, request_id_problem
from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc, scheduler_pb2
from hetero_common.config import BackendConfig, CommandConfig, Config, ServingConfig
from hetero_common.errors import UnavailableError, ValidationError
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer

BAD_IDS = ["a\x00b", "\x00", "tab\there", "new\nline", "bell\x07", "del\x7f", "caf\u00e9", "\u2028", "x" * 129]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return load_tokenizer(directory)


def http_api(tokenizer: TextTokenizer, serving: ServingConfig | None = None) -> HttpApi:
    backend = BackendConfig(kind="command_bridge", command=CommandConfig("/bin/echo", ["ok"]))
    config = Config(max_model_len=64)
    config.serving.backend = backend
    generation = Generation(config, tokenizer, CommandBridgeBackend(CommandBridge(backend), tokenizer, "tiny"))

    async def no_scheduler() -> scheduler_pb2.SchedulerStats:
        raise UnavailableError("no scheduler in this test")

    return HttpApi(generation, ApiKeys([]), no_scheduler, serving)


@pytest.fixture(scope="module")
def client(tokenizer: TextTokenizer):
    with TestClient(http_api(tokenizer, ServingConfig(max_prompts_per_request=4)).app) as c:
        yield c


def post(client: TestClient, body: Any, path: str = "/v1/completions", **headers: str):
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"content-type": "application/json", **headers})


def nested_schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


# ----------------------------------------------------------------------------------- the prompt cap

@pytest.mark.parametrize("prompt", [["x"] * 5, [[1, 2]] * 5])
def test_more_prompts_than_the_cap_is_a_400_naming_prompt(client: TestClient, prompt: list[Any]) -> None:
    response = post(client, {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "max_prompts_per_request" in error["message"]


def test_the_cap_is_checked_before_any_prompt_is_tokenized(tokenizer: TextTokenizer) -> None:
    api = http_api(tokenizer, ServingConfig(max_prompts_per_request=2))
    calls: list[Any] = []
    real_run = api.generation.tokenizer_pool.run

    async def counting_run(*args: Any, **kw: Any) -> Any:
        calls.append(args[0])
        return await real_run(*args, **kw)

    api.generation.tokenizer_pool.run = counting_run  # type: ignore[method-assign]
    with TestClient(api.app) as c:
        response = post(c, {"prompt": ["x"] * 3, "add_special_tokens": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert calls == []


def test_prompts_up_to_the_cap_are_served_with_their_indices_and_usage_summed(client: TestClient) -> None:
    response = post(client, {"prompt": ["a", "b b", "c", "d"], "max_tokens": 4, "n": 2})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == list(range(8))
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


# ----------------------------------------------------------------------------------- the window

class FakeGeneration:
    """What `merged` uses of Generation: each request answers two messages per sample, its usage on
    the last; how many run at once is recorded."""

    model_name = "tiny"

    def __init__(self) -> None:
        self.active = ActiveRequests()
        self.running = 0
        self.most = 0
        self.started: list[str] = []

    async def generate(self, request: inference_pb2.GenerateRequest,
                       client_request_id: str | None = None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self.running += 1
        self.most = max(self.most, self.running)
        self.started.append(request.request_id)
        try:
            n = max(1, request.params.n)
            for step in range(2):
                await asyncio.sleep(0.001)
                for j in range(n):
                    part = inference_pb2.GenerateResponse(request_id=request.request_id, index=j, text=f"{step}")
                    if step == 1:
                        part.finish_reason = common_pb2.FINISH_REASON_LENGTH
                        if j == n - 1:
                            part.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=2 * n))
                    yield part
        finally:
            self.running -= 1


def requests(count: int, n: int) -> list[inference_pb2.GenerateRequest]:
    return [inference_pb2.GenerateRequest(request_id=f"r-{i}", prompt="x", params=common_pb2.SamplingParams(n=n))
            for i in range(count)]


def test_merged_runs_a_window_of_prompts_in_order_keeping_indices_and_usage() -> None:
    generation = FakeGeneration()

    async def collect() -> list[tuple[int, inference_pb2.GenerateResponse]]:
        return [e async for e in streams.merged(generation, requests(10, 3), 3, "r", window=4)]  # type: ignore[arg-type]

    events = asyncio.run(collect())
    assert generation.most == 4 and generation.started == [f"r-{i}" for i in range(10)]
    by_choice: dict[int, list[inference_pb2.GenerateResponse]] = {}
    for index, part in events:
        by_choice.setdefault(index, []).append(part)
        assert part.request_id == f"r-{index // 3}" and part.index == index % 3
    assert sorted(by_choice) == list(range(30)) and all(len(p) == 2 for p in by_choice.values())
    usages = [p.usage for _, p in events if p.HasField("usage")]
    assert len(usages) == 10 and sum(u.completion_tokens for u in usages) == 60
    assert not generation.active.aborted and len(generation.active) == 0


def test_the_default_window_bounds_a_request_at_the_cap() -> None:
    generation = FakeGeneration()

    async def drain() -> None:
        async for _ in streams.merged(generation, requests(128, 1), 1, "r"):  # type: ignore[arg-type]
            pass

    asyncio.run(drain())
    assert generation.most == streams.PROMPTS_IN_FLIGHT < 128 and len(generation.started) == 128


def test_a_prompt_aborted_before_its_turn_is_never_started() -> None:
    generation = FakeGeneration()

    async def collect() -> list[tuple[int, inference_pb2.GenerateResponse]]:
        events = []
        async for event in streams.merged(generation, requests(4, 2), 2, "r", window=1):  # type: ignore[arg-type]
            if not events:  # the first prompt runs; the others wait: an Abort of the client id lands
                generation.active.mark_aborted(generation.active.lookup("r"))
            events.append(event)
        return events

    events = asyncio.run(collect())
    assert generation.started == ["r-0"]
    ends = {i: p.finish_reason for i, p in events if p.finish_reason}
    assert sorted(ends) == list(range(8))
    assert all(ends[i] == common_pb2.FINISH_REASON_ABORT for i in range(2, 8))
    assert sum(1 for _, p in events if p.HasField("usage")) == 4  # one per prompt, as a streamed usage sums them


def test_an_error_in_one_prompt_cancels_the_waiting_ones() -> None:
    generation = FakeGeneration()
    real = generation.generate

    async def failing(request: inference_pb2.GenerateRequest, client_request_id: str | None = None):
        if request.request_id == "r-1":
            raise ValidationError("prompt is bad", "prompt")
        async for part in real(request, client_request_id):
            yield part

    generation.generate = failing  # type: ignore[method-assign]

    async def drain() -> None:
        async for _ in streams.merged(generation, requests(6, 1), 1, "r", window=2):  # type: ignore[arg-type]
            pass

    with pytest.raises(ValidationError):
        asyncio.run(drain())
    assert "r-5" not in generation.started and len(generation.active) == 0


# ----------------------------------------------------------------------------------- nesting

@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5_000, 60_000])
def test_a_body_nested_too_deeply_is_a_400_before_it_is_parsed(client: TestClient, depth: int) -> None:
    body = '{"prompt":"x","logit_bias":' + "[" * depth + "]" * depth + "}"
    response = post(client, body)
    assert response.status_code in (400, 413), response.text  # 413: over the body's value cap first
    assert response.json()["error"]["type"] == "invalid_request_error"
    if response.status_code == 400:
        assert "nests" in response.json()["error"]["message"]


def test_brackets_inside_strings_do_not_count_as_nesting(client: TestClient) -> None:
    response = post(client, {"prompt": "[" * 5000 + "{" * 5000, "max_tokens": 1})
    assert response.status_code != 400 or "nests" not in response.text, response.text


@pytest.mark.parametrize("field", ["response_format", "guided_json"])
@pytest.mark.parametrize("levels", [40, 100, 600])
def test_a_schema_nested_too_deeply_is_a_400_naming_its_field(client: TestClient, field: str, levels: int) -> None:
    schema = nested_schema(levels)
    if field == "response_format":
        body = '{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"a","schema":' + schema + "}}}"
    else:
        body = json.dumps({"prompt": "x", "guided_json": schema})  # as JSON text: the body itself is flat
    response = post(client, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in (field, None), error  # None: the body was refused for its own nesting first
    assert "nest" in error["message"], error


def test_grpc_deep_schema_nul_id_and_abort_get_their_statuses(tokenizer: TextTokenizer) -> None:
    generation = http_api(tokenizer).generation
    deep = inference_pb2.GenerateRequest(prompt="x", params=common_pb2.SamplingParams(
        max_tokens=1, json_schema=nested_schema(500)))
    nul = inference_pb2.GenerateRequest(request_id="a\x00b", prompt="x", params=common_pb2.SamplingParams(max_tokens=1))

    async def main() -> tuple[list[tuple[grpc.StatusCode, str]], inference_pb2.AbortGenerationResponse, str]:
        server = grpc.aio.server()
        add_inference_servicer(InferenceServicer(generation), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        failures = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                for request in (deep, nul):
                    for call in (stub.Complete, stub.Generate):
                        try:
                            answer = call(request, timeout=30)
                            if hasattr(answer, "__aiter__"):
                                async for _ in answer:
                                    pass
                            else:
                                await answer
                        except grpc.aio.AioRpcError as exc:
                            failures.append((exc.code(), exc.details() or ""))
                embed = inference_pb2.EmbedRequest(request_id="e\x01", inputs=[inference_pb2.EmbedInput(text="x")])
                try:
                    await stub.Embed(embed, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    failures.append((exc.code(), exc.details() or ""))
                aborted = await stub.Abort(inference_pb2.AbortGenerationRequest(request_ids=["a\x00b", "ok-id"]), timeout=30)
                after = await stub.Complete(inference_pb2.GenerateRequest(
                    prompt="x", params=common_pb2.SamplingParams(max_tokens=2)), timeout=30)
        finally:
            await server.stop(None)
        return failures, aborted, after.text

    failures, aborted, text = asyncio.run(main())
    assert [code for code, _ in failures] == [grpc.StatusCode.INVALID_ARGUMENT] * 5, failures
    assert all("json_schema" in d for _, d in failures[:2]) and all("request_id" in d for _, d in failures[2:]), failures
    assert "a\x00b" in aborted.not_found and "ok-id" in aborted.not_found
    assert text  # and the servicer still serves


# ----------------------------------------------------------------------------------- request ids

@pytest.mark.parametrize("bad", BAD_IDS)
def test_request_ids_outside_printable_ascii_are_refused_naming_request_id(bad: str) -> None:
    assert request_id_problem(bad) is not None
    with pytest.raises(ValidationError) as caught:
        check_request_id(bad)
    assert caught.value.param == "request_id" and caught.value.message.startswith("request_id")
    limits = EmbeddingLimits("tiny", 64, 8, None, False)
    with pytest.raises(ValidationError) as caught:
        check_request(inference_pb2.EmbedRequest(request_id=bad, inputs=[inference_pb2.EmbedInput(text="x")]), limits)
    assert caught.value.param == "request_id"


@pytest.mark.parametrize("good", ["", "req-1", "a b/c:d.e_f~!", "x" * MAX_REQUEST_ID_LEN, "key-0123456789ab/id"])
def test_printable_ascii_request_ids_are_taken(good: str) -> None:
    assert request_id_problem(good) is None
    check_request_id(good)


@pytest.mark.parametrize("header", [b"abc\n", b"a\x00b", b"caf\xc3\xa9", b"sp ace", b"", b"x" * 101])
def test_a_bad_x_request_id_header_is_a_400_naming_it(header: bytes) -> None:
    """Driven as ASGI: an HTTP client would not send most of these, a raw socket can (a trailing newline
    passed the old `re.match` check, whose `$` matches before it)."""
    sent: list[dict[str, Any]] = []
    reached: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"x-request-id", header)]}
    asyncio.run(RequestIdMiddleware(app, error_body)(scope, receive, send))
    assert not reached and sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == "X-Request-Id"


# ----------------------------------------------------------------------------------- internal errors

def test_an_unexpected_http_error_is_a_generic_500_with_the_request_id(tokenizer: TextTokenizer) -> None:
    api = http_api(tokenizer)

    async def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("secret: /etc/hetero/keys.yaml at 10.0.0.7")
        yield  # an async generator, as Generation.generate is

    api.generation.generate = broken  # type: ignore[method-assign]
    with capture_logs() as logs, TestClient(api.app, raise_server_exceptions=False) as c:
        plain = post(c, {"prompt": "x", "max_tokens": 1}, **{"x-request-id": "boom-1"})
        streamed = post(c, {"prompt": "x", "max_tokens": 1, "stream": True}, **{"x-request-id": "boom-2"})
    for response, rid in ((plain, "boom-1"), (streamed, "boom-2")):
        assert response.status_code == 500 and response.headers["content-type"].startswith("application/json")
        message = response.json()["error"]["message"]
        assert rid in message and "secret" not in message and "RuntimeError" not in message, message
        assert response.json()["error"]["type"] == "server_error"
    logged = [e for e in logs if e.get("event") == "internal error"]
    assert {e["request_id"] for e in logged} == {"boom-1", "boom-2"}
    assert all(e["error_type"] == "RuntimeError" and "secret" in e["error"] and e.get("exc_info") for e in logged)
