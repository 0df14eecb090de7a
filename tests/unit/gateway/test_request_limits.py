"""The HTTP body limits (`gateway/openai/body_limit.py`), driven as ASGI directly, so what the
middleware reads is counted; the gateway's real app for the answer's shape and `/metrics`'s key;
the public gRPC server's options. The limits on a real server (sockets, timeouts, connection
cap, gRPC) are tests/stack/test_request_limits.py's."""

from __future__ import annotations

import asyncio
import gc
import json
import types
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

import gateway
from gateway.auth import ApiKeyInterceptor, ApiKeys
from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.generation import Generation
from gateway.grpc.grpc_api import InferenceServicer, add_inference_servicer
from gateway.openai.app import HttpApi, error_body
from gateway.openai.body_limit import BodyLimitMiddleware
from gateway.openai.json_body import OTHER_VALUES, counted_values, values_outside_strings
from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc, scheduler_pb2
from hetero_common.config import BackendConfig, CommandConfig, Config, ServingConfig
from hetero_common.errors import UnavailableError
from hetero_common.grpc_server import CHANNEL_OPTIONS, internal_server_options, public_server_options
from hetero_common.tokenizer import load_tokenizer
from hetero_infer.bench.harness import make_tokenizer

CAP = 1000


class Recorder:
    """The route behind the middleware: what it was given."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        first = await receive()
        self.calls.append(first)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        self.calls.append(await receive())  # after the body: the server's own receive (disconnect)


class Client:
    """The server side of one request: the body as messages, counted as they are read."""

    def __init__(self, chunks: list[bytes], stall_after: int | None = None) -> None:
        self.chunks, self.stall_after, self.read = chunks, stall_after, 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.read >= len(self.chunks) or self.read == self.stall_after:
            if self.read == self.stall_after:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}
        self.read += 1
        return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": self.read < len(self.chunks)}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def error(self) -> dict[str, Any]:
        return json.loads(self.sent[1]["body"])["error"]


def run(client: Client, headers: list[tuple[bytes, bytes]] = (), timeout_s: float = 5.0) -> Recorder:  # type: ignore[assignment]
    route = Recorder()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
    asyncio.run(BodyLimitMiddleware(route, CAP, timeout_s, error_body)(scope, client.receive, client.send))
    return route


def test_a_declared_length_over_the_cap_is_refused_before_any_of_the_body_is_read() -> None:
    client = Client([b"x" * 10] * 500)
    route = run(client, [(b"content-length", b"67108864")])
    assert client.read == 0 and route.calls == []
    assert client.status == 413 and client.headers[b"connection"] == b"close"
    assert client.error == {"message": client.error["message"], "type": "invalid_request_error", "param": None, "code": None}
    assert "67108864" in client.error["message"] and "serving.max_request_bytes" in client.error["message"]


def test_a_chunked_body_is_read_only_until_it_passes_the_cap() -> None:
    client = Client([b"x" * 300] * 100)
    route = run(client)
    assert client.read == 4 and route.calls == []  # 1200 bytes > 1000: the other 96 chunks are never read
    assert client.status == 413 and "serving.max_request_bytes" in client.error["message"]


def test_a_lying_content_length_is_caught_by_counting() -> None:
    client = Client([b"x" * 600] * 3)
    run(client, [(b"content-length", b"10")])
    assert client.status == 413 and client.read == 2


def test_a_body_within_the_cap_reaches_the_route_whole_and_then_the_server_receive() -> None:
    client = Client([b"a" * 400, b"", b"b" * 600])  # exactly the cap
    route = run(client, [(b"content-length", b"1000")])
    assert route.calls[0] == {"type": "http.request", "body": b"a" * 400 + b"b" * 600, "more_body": False}
    assert route.calls[1] == {"type": "http.disconnect"}  # a streaming route still sees the client leave
    assert client.status == 200


def test_a_stalled_body_is_answered_408_after_the_body_timeout() -> None:
    client = Client([b"x" * 10] * 5, stall_after=2)
    route = run(client, timeout_s=0.2)
    assert route.calls == [] and client.status == 408 and client.headers[b"connection"] == b"close"
    assert client.error["type"] == "invalid_request_error" and "serving.http_body_timeout_s" in client.error["message"]
    assert "20 bytes came" in client.error["message"]


def test_a_client_gone_before_its_body_gets_no_answer() -> None:
    client = Client([])
    route = run(client)
    assert route.calls == [] and client.sent == []


def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(BodyLimitMiddleware(app, CAP, 1.0, error_body)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan"]


# --- the gateway's app: the 413 in OpenAI's shape with the request id; /metrics's key ----------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return directory


def http_api(tokenizer_dir: Path, keys: list[str], serving: ServingConfig) -> HttpApi:
    tokenizer = load_tokenizer(tokenizer_dir)
    generation = Generation(Config(), tokenizer, CommandBridgeBackend(
        CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig("/bin/echo"))), tokenizer, "tiny"))

    async def no_scheduler() -> scheduler_pb2.SchedulerStats:
        raise UnavailableError("no scheduler in this test")

    return HttpApi(generation, ApiKeys(keys), no_scheduler, serving)


def test_the_app_answers_an_oversized_body_413_like_its_other_errors(tokenizer_dir: Path) -> None:
    with TestClient(http_api(tokenizer_dir, [], ServingConfig(max_request_bytes=2048)).app) as client:
        big = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x " * 2000},
                          headers={"x-request-id": "big-1"})
        small = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x", "n": 0})
    assert big.status_code == 413 and big.headers["x-request-id"] == "big-1"
    assert big.json()["error"].keys() == small.json()["error"].keys() and small.status_code == 400
    assert big.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("require", [False, True])
def test_metrics_needs_a_key_only_when_asked(tokenizer_dir: Path, require: bool) -> None:
    api = http_api(tokenizer_dir, ["k1"], ServingConfig(metrics_require_key=require))
    with TestClient(api.app) as client:
        bare = client.get("/metrics")
        assert bare.status_code == (401 if require else 200)
        if require:
            assert bare.json()["error"]["type"] == "authentication_error"
            assert client.get("/metrics", headers={"authorization": "Bearer nope"}).status_code == 401
        assert client.get("/metrics", headers={"authorization": "Bearer k1"}).status_code == 200
        assert client.get("/healthz").status_code == 200  # the probes stay open
        assert client.get("/readyz").status_code == 503  # open too: no scheduler here, not a 401


def test_metrics_stays_open_without_keys_even_when_asked(tokenizer_dir: Path) -> None:
    with TestClient(http_api(tokenizer_dir, [], ServingConfig(metrics_require_key=True)).app) as client:
        assert client.get("/metrics").status_code == 200


def test_the_public_grpc_server_follows_the_limits_and_the_internal_ones_keep_theirs() -> None:
    serving = ServingConfig(max_request_bytes=5000, max_connections=3, grpc_idle_timeout_s=2.5,
                            http_header_timeout_s=1.5, grpc_max_concurrent_streams=9)
    options = dict(public_server_options(serving))
    assert options["grpc.max_receive_message_length"] == 5000
    assert options["grpc.max_allowed_incoming_connections"] == 3
    assert options["grpc.max_connection_idle_ms"] == 2500 and options["grpc.server_handshake_timeout_ms"] == 1500
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.max_send_message_length"] == dict(CHANNEL_OPTIONS)["grpc.max_send_message_length"]
    assert len(options) == len(public_server_options(serving))  # no key twice
    assert "grpc.max_allowed_incoming_connections" not in dict(public_server_options(ServingConfig(max_connections=0)))
    internal = dict(internal_server_options(Config(serving=serving)))
    assert internal["grpc.max_receive_message_length"] == dict(CHANNEL_OPTIONS)["grpc.max_receive_message_length"]


def test_a_grpc_message_over_the_cap_is_refused_at_once_not_after_grpcs_tarpit() -> None:
    """gRPC's tarpit would hold each refusal back 0.1-1 s (public_server_options turns it off). Told
    by the order of two answers, not by a clock: a 2 kB message against a 1 kB cap, and right after
    it a small call on the same channel. Refused by the gRPC core as the message arrives, the first
    is answered before the second, which the application's handler must run for; held back by the
    tarpit, it would come after. Five rounds, each of which the tarpit's delay would reorder."""
    async def main() -> list[list[str]]:
        server = grpc.aio.server(options=public_server_options(ServingConfig(max_request_bytes=1000)))

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return request
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                echo_call = channel.unary_unary("/t.Echo/Echo")
                assert await echo_call(b"x" * 100, timeout=30) == b"x" * 100
                return [await _answer_order(echo_call) for _ in range(5)]
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == [["RESOURCE_EXHAUSTED", "served"]] * 5


async def _answer_order(echo_call: Any) -> list[str]:
    """The order in which a refused call (sent first) and a served one (sent right after) are answered."""
    order: list[str] = []

    async def refused() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await echo_call(b"x" * 2000, timeout=30)
        order.append(error.value.code().name)

    async def served() -> None:
        assert await echo_call(b"y" * 10, timeout=30) == b"y" * 10
        order.append("served")

    first = asyncio.ensure_future(refused())
    await asyncio.sleep(0)  # its call started: its message goes out before the second call's
    await asyncio.gather(first, served())
    return order


def test_a_body_of_more_values_than_a_request_can_hold_is_refused_413_unparsed(tokenizer_dir: Path) -> None:
    """Counted by commas and brackets before json.loads runs (json_body.py): max_model_len token ids
    plus OTHER_VALUES is the most a served request holds; a long prompt string is one value."""
    api = http_api(tokenizer_dir, [], ServingConfig())
    cap = api.generation.max_model_len + OTHER_VALUES
    bias = {str(i): 1 for i in range(cap)}  # cap entries: cap - 1 commas, over the cap with the body's own
    with TestClient(api.app) as client:
        refused = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x",
                                                       "logit_bias": bias})
        deep = client.post("/v1/completions", content=b"[" * (cap + 1) + b"]" * (cap + 1),
                           headers={"content-type": "application/json"})
        commas = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "a, " * 600,
                                                      "max_tokens": 1})
    for answer in (refused, deep):
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error" and f"at most {cap}" in answer.json()["error"]["message"]
    assert commas.status_code == 200, commas.text  # well under the cap: parsed and served (by the bridge)


@pytest.mark.parametrize("text", ["a, [b], {c}, " * 50, 'quoted "a, b", ' * 50, "a backslash \\, then: [" * 50,
                                  "[a backslash at the end, \\" * 50, '\\", "x": [1, 2], "y": "z, [' * 20])
def test_commas_and_brackets_inside_strings_are_not_counted_as_values(text: str) -> None:
    """The second count (json_body.values_outside_strings): escapes followed as JSON does, so a
    string's commas and brackets, escaped quotes and backslashes among them, count for nothing."""
    def body(prompt: str) -> bytes:
        return json.dumps({"prompt": prompt, "stop": ["x", "y"], "logit_bias": {"1": 2}}).encode()

    assert counted_values(body(text)) > 100
    assert values_outside_strings(body(text), cap=10) == values_outside_strings(body("plain"), cap=10) == 7  # its strings


def test_a_body_of_more_strings_than_the_cap_is_counted_by_its_strings() -> None:
    body = json.dumps({"logit_bias": {str(i): 1 for i in range(500)}}).encode()
    assert values_outside_strings(body, cap=100) == 501  # its keys and "logit_bias": each an object json.loads makes


def test_a_refused_grpc_request_is_freed_at_once_not_by_a_later_garbage_collection(tokenizer_dir: Path) -> None:
    """A refused call ends with its status set, not with an exception (grpc_server.end_call): an
    exception leaving a grpc.aio handler stays in a reference cycle of grpc's frames, and the
    request with it, until the collector's next full pass. A client sending refused 4 MiB
    prompts grew the gateway by 8 MiB a request that way."""
    generation = http_api(tokenizer_dir, [], ServingConfig()).generation
    too_long = inference_pb2.GenerateRequest(prompt="word " * 20_000, params=common_pb2.SamplingParams(max_tokens=1))

    async def main() -> tuple[list[Any], list[grpc.StatusCode]]:
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys(["sk-1"]))])
        add_inference_servicer(InferenceServicer(generation), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                for key, call in [("sk-1", stub.Generate), ("sk-1", stub.Complete), ("wrong", stub.Generate),
                                  ("wrong", stub.Complete)]:
                    try:
                        await asyncio.wait_for(_drain(call(too_long, metadata=(("authorization", f"Bearer {key}"),))), 30)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
        finally:
            await server.stop(None)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return [o for o in gc.garbage if isinstance(o, types.FrameType) and _servers_frame(o.f_code.co_filename)], codes
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    gc.collect()
    cycles, codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2 + [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert not cycles, cycles[:5]


def _servers_frame(filename: str) -> bool:
    """A frame of the gateway's handlers or of grpc's server (not of the test's client)."""
    return filename.startswith(str(Path(gateway.__file__).parent) + "/") or "server.pyx" in filename


async def _drain(call: Any) -> None:
    if hasattr(call, "__aiter__"):
        async for _ in call:
            pass
    else:
        await call
