"""HTTP/1.1 spoken over a raw socket, for tests where what the client sends, and when, is the
point (a body that never comes, a request line cut short), and the gateway's memory after such
requests."""

from __future__ import annotations

import json
import socket
import time

import psutil

from hetero_infer.bench.harness import Stack

HANG_GUARD_S = 30.0  # a wait for the server that has not ended by then hangs


def connect(stack: Stack) -> socket.socket:
    sock = socket.create_connection((stack.host, stack.http_port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body (what the limits answer)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, timeout_s: float = HANG_GUARD_S) -> bool:
    """Whether the server closes `sock` (an end of stream or a reset) within `timeout_s`, reading and
    dropping anything it sends meanwhile. A hang guard, not a measure: the timeouts the tests set are
    a second or two."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def completion_head(length: int | None, key: str, chunked: bool = False) -> bytes:
    """The request line and headers of a POST /v1/completions whose body is `length` bytes (or chunked)."""
    framing = "transfer-encoding: chunked\r\n" if chunked else f"content-length: {length}\r\n"
    return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {key}\r\n{framing}\r\n").encode()


def assert_openai_error(body: bytes, kind: str, mentions: str) -> None:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind
    assert mentions in error["message"], error["message"]


def settled_rss(process: psutil.Process, before: int, timeout_s: float = 10.0) -> int:
    """The process's RSS once it is back within 50 MiB of `before` (the gateway trims its heap a
    second after a large input), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (rss := process.memory_info().rss) - before >= 50 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.25)
    return rss
