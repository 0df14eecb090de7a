"""The request limits on a real `serve` (issue 43, items 1, 5, 6): the body cap on HTTP (declared
and chunked) and gRPC, the header, body and keep-alive timeouts, the connection cap, and
`/metrics` behind the API key. The timeouts are set small so each case takes about a second;
nothing may answer 5xx. Raw sockets where the timing of what the client sends is the point.

Each case checks what happens (the status and its message, the close, an answer that came though
the body never did), not how soon: on a shared machine the gateway's timers run late by turns. A
wait for the server is bounded by a hang guard (HANG_GUARD_S) many times the timeouts set here."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import Stack, run_stack
from tests.helpers.raw_http import (HANG_GUARD_S, assert_openai_error, closed_by_server, completion_head, connect,
                                    read_response)
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow
KEY = "sk-limits-1"
AUTH = {"authorization": f"Bearer {KEY}"}
CAP = 65536
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS = 1.5, 1.5, 1.0, 6


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    with run_stack(tiny_llama_dir, "--serving-max-request-bytes", str(CAP),
                   "--serving-http-header-timeout-s", str(HEADER_TIMEOUT_S),
                   "--serving-http-body-timeout-s", str(BODY_TIMEOUT_S),
                   "--serving-http-keep-alive-timeout-s", str(KEEP_ALIVE_S),
                   "--serving-max-connections", str(MAX_CONNECTIONS), "--serving-api-keys", KEY,
                   "--serving-metrics-require-key", "true", "--log-level", "warning") as s:
        yield s


def test_a_declared_64_mib_body_gets_413_before_it_is_sent(stack: Stack) -> None:
    with connect(stack) as sock:
        # 1 KB of the 64 MiB, and nothing more: an answer can only be the one to the declared length.
        sock.sendall(completion_head(64 * 1024 * 1024, KEY) + b'{"prompt": "' + b"x" * 1000)
        status, headers, body = read_response(sock, timeout_s=HANG_GUARD_S)
        assert status == 413 and headers["connection"] == "close"
        assert_openai_error(body, "invalid_request_error", "serving.max_request_bytes")
        sock.sendall(b"x" * 100_000)  # the client still sending: dropped, not reset under it
        assert closed_by_server(sock)


def test_a_client_that_sends_all_64_mib_reads_the_413_not_a_reset(stack: Stack) -> None:
    with httpx.Client(base_url=stack.http_url, headers=AUTH, timeout=HANG_GUARD_S) as client:
        response = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}',
                               headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert_openai_error(response.content, "invalid_request_error", "serving.max_request_bytes")


def test_a_chunked_body_past_the_cap_gets_413_without_its_end(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(completion_head(None, KEY, chunked=True))
        piece = b"y" * 16384
        for _ in range(CAP // len(piece) + 1):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        status, _, body = read_response(sock, timeout_s=HANG_GUARD_S)  # no last chunk was sent: it is not waited for
        assert status == 413
        assert_openai_error(body, "invalid_request_error", "serving.max_request_bytes")


def test_a_body_within_the_cap_is_served(stack: Stack) -> None:
    with httpx.Client(base_url=stack.http_url, headers=AUTH, timeout=30) as client:
        prompt = "hello " * (CAP // 12)  # about half the cap: refused for its length in tokens, not its size
        response = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt})
        assert response.status_code == 400 and "tokens" in response.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_a_grpc_message_over_the_cap_is_resource_exhausted(stack: Stack) -> None:
    metadata = (("authorization", f"Bearer {KEY}"),)
    big = inference_pb2.GenerateRequest(prompt="z" * (CAP + 10), params=common_pb2.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as refused:
        list(stack.inference.Generate(big, metadata=metadata, timeout=10))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {CAP}" in refused.value.details()  # gRPC's "Received message larger than max (N vs. CAP)"
    small = inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2))
    assert list(stack.inference.Generate(small, metadata=metadata, timeout=30))  # the channel is still good


def test_grpc_connections_beyond_the_cap_are_closed_and_later_ones_served(stack: Stack) -> None:
    def check(channel: grpc.Channel) -> grpc.StatusCode:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    own = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel, not one shared
    channels = [grpc.insecure_channel(stack.address, options=own) for _ in range(MAX_CONNECTIONS + 2)]
    try:
        codes = [check(channel) for channel in channels]
    finally:
        for channel in channels:
            channel.close()
    assert codes.count(grpc.StatusCode.OK) <= MAX_CONNECTIONS - 1  # the stack's own channel holds one
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes

    def served_on_a_new_connection() -> bool:
        with grpc.insecure_channel(stack.address, options=own) as channel:
            return check(channel) == grpc.StatusCode.OK

    # The server counts a connection down when it sees it closed, a moment after the client closed it.
    wait_until(served_on_a_new_connection, interval=0.1, what="a new gRPC connection served once the held ones closed")


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(stack: Stack) -> None:
    """Kept open after the answer (no `connection: close`, which the server sends when it closes at
    once), then closed by the server with no request on it: the keep-alive timeout's doing."""
    with connect(stack) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, _ = read_response(sock, timeout_s=HANG_GUARD_S)
        assert status == 200 and headers.get("connection") != "close", headers
        assert closed_by_server(sock)


@pytest.mark.parametrize("request_head", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2**20 + b"\r\n\r\n",  # headers of 1 MiB
    b"NOT HTTP AT ALL\r\n\r\n"])
def test_a_request_h11_cannot_parse_gets_400_in_the_api_error_shape(stack: Stack, request_head: bytes) -> None:
    with connect(stack) as sock:  # sent on a thread while the answer is read: it comes before the rest is sent
        writer = threading.Thread(target=sock.sendall, args=(request_head,))
        writer.start()
        status, headers, body = read_response(sock, timeout_s=HANG_GUARD_S)
        writer.join()  # the gateway reads and drops the rest (a lingering close), so the send completes
    assert status == 400 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert_openai_error(body, "invalid_request_error", "not HTTP/1.1 that the gateway can parse")


def test_a_client_sending_its_headers_slowly_is_cut_off(stack: Stack) -> None:
    """A byte each 0.25 s: the 64 bytes would take 16 s, ten times the header timeout, however
    often they come. The server closes the connection before they are all sent, and answers nothing."""
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-padding: " + b"p" * 40 + b"\r\n\r\n"
    with connect(stack) as sock:
        sent = sent_before_the_close(sock, request)
    assert sent < len(request), "every byte of the headers was sent and the connection was still open"


def sent_before_the_close(sock: socket.socket, request: bytes) -> int:
    """How many bytes of `request`, sent one each 0.25 s, went before the server closed `sock`."""
    for sent, byte in enumerate(request):
        try:
            sock.sendall(bytes([byte]))
            sock.settimeout(0.25)
            answer = sock.recv(1)
        except socket.timeout:
            continue
        except OSError:  # reset, or a broken pipe
            answer = b""
        assert answer == b"", "the server answered a request whose headers never completed"
        return sent + 1
    return len(request)


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(stack: Stack) -> None:
    with connect(stack) as sock:
        assert closed_by_server(sock)


def test_a_stalled_body_gets_408_after_the_body_timeout(stack: Stack) -> None:
    with connect(stack) as sock:
        sock.sendall(completion_head(1000, KEY) + b'{"prompt": "')
        status, headers, body = read_response(sock, timeout_s=HANG_GUARD_S)
        assert status == 408 and headers["connection"] == "close"
        assert_openai_error(body, "invalid_request_error", "serving.http_body_timeout_s")
        assert_openai_error(body, "invalid_request_error", f"within {BODY_TIMEOUT_S:g} s of its headers")  # the one set
        assert closed_by_server(sock)


def accepted_by_the_gateway(stack: Stack, socks: list[socket.socket]) -> bool:
    """Whether the gateway has accepted each of `socks` (holds its end as a socket of its own; one
    still in the kernel's accept queue it does not). It accepts in the order they connected."""
    ports = {sock.getsockname()[1] for sock in socks}
    accepted = {c.raddr.port for c in stack.service_process("gateway").net_connections(kind="tcp")
                if c.raddr and c.laddr.port == stack.http_port}
    return ports <= accepted


def test_connections_beyond_the_cap_get_429_and_later_ones_are_served(stack: Stack) -> None:
    held = [connect(stack) for _ in range(MAX_CONNECTIONS)]
    try:
        # Counted by the server before the extra one comes. Not a fixed sleep: the held connections
        # send nothing, so the header timeout closes them HEADER_TIMEOUT_S after they were accepted.
        wait_until(lambda: accepted_by_the_gateway(stack, held), interval=0.01,
                   what=f"the gateway accepting the {MAX_CONNECTIONS} held connections")
        with connect(stack) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            status, headers, body = read_response(extra, timeout_s=HANG_GUARD_S)
            assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert_openai_error(body, "rate_limit_error", "serving.max_connections")
    finally:
        for sock in held:
            sock.close()
    # The server notices the closes on its next loop turn: until then a new connection is over the cap.
    wait_until(lambda: httpx.get(f"{stack.http_url}/healthz", timeout=5).status_code == 200, interval=0.1,
               what="/healthz answered 200 on a new connection once the held ones closed")


def test_metrics_needs_the_key_and_the_probes_stay_open(stack: Stack) -> None:
    with httpx.Client(base_url=stack.http_url, timeout=10) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401
        assert_openai_error(refused.content, "authentication_error", "API key")
        assert client.get("/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        metrics = client.get("/metrics", headers=AUTH)
        assert metrics.status_code == 200 and "hetero_" in metrics.text
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
