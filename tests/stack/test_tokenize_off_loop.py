"""A large prompt delays only itself, on the real stack: refused before it is tokenized when it cannot
fit, tokenized off the gateway's event loop when it must be (/tokenize, gRPC Tokenize), the answer
(every id and its token's text) built and serialized there too. Meanwhile a second client asks
GET /v1/models back to back, and every one of its requests is answered.

What runs on which thread, and that the heap is trimmed after, is checked in-process with a
recording wrapper around each real step (tests/unit/gateway/test_tokenize_off_loop.py); not here by
how long the second client waits, which on a shared machine says more about the machine than about
the gateway (benchmarks/hostile_prompt.py measures it)."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import httpx
import pytest

from hetero.v1 import inference_pb2, inference_pb2_grpc
from hetero_infer.bench.harness import Stack, run_stack

pytestmark = pytest.mark.slow
_rng = random.Random(0)
MIB4 = " ".join(_rng.choice(["alpha", "bravo", "delta", "echo", "golf", "kilo"]) for _ in range(4 * 2**20 // 6))  # 3.7 MiB: under the default body cap (4 MiB)
HANG_GUARD_S = 120  # a call not answered by then hangs (the largest takes seconds)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    with run_stack(tiny_llama_dir) as s:
        httpx.post(f"{s.http_url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        yield s


def while_asking(url: str, action: Callable[[], Any]) -> tuple[Any, list[int]]:
    """action()'s result, and the statuses of the GET /v1/models a second client sent back to back
    meanwhile (from its first answer, before action() starts, until action() is done)."""
    statuses: list[int] = []
    first, stop = threading.Event(), threading.Event()

    def ask() -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            while not stop.is_set():
                statuses.append(client.get(f"{url}/v1/models").status_code)
                first.set()

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        assert first.wait(HANG_GUARD_S), "the second client got no answer"
        result = action()
    finally:
        stop.set()
        asker.join()
    return result, statuses


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(stack: Stack) -> None:
    with httpx.Client(timeout=HANG_GUARD_S) as client:
        answer, statuses = while_asking(
            stack.http_url, lambda: client.post(f"{stack.http_url}/v1/completions", json={"prompt": MIB4, "max_tokens": 1}))
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    # "at least": the lower bound the length gives, before tokenizing (a count would say "prompt is N tokens").
    assert message.startswith("prompt is at least ") and "max_model_len is 512" in message, message
    assert statuses and set(statuses) == {200}, statuses


def test_chat_messages_that_cannot_fit_are_refused_summed(stack: Stack) -> None:
    half = MIB4[: len(MIB4) // 2]
    body = {"messages": [{"role": "user", "content": half}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": half}], "max_tokens": 1}
    answer = httpx.post(f"{stack.http_url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("prompt is at least ")


def test_a_large_tokenize_runs_beside_other_clients(stack: Stack) -> None:
    with httpx.Client(timeout=HANG_GUARD_S) as client:
        answer, statuses = while_asking(
            stack.http_url, lambda: client.post(f"{stack.http_url}/tokenize", json={"prompt": MIB4}))
    assert answer.status_code == 200
    body = answer.json()
    assert body["count"] > 100_000 and len(body["tokens"]) == body["count"]
    assert statuses and set(statuses) == {200}, statuses


def test_a_large_grpc_tokenize_runs_beside_other_clients(stack: Stack) -> None:
    request = inference_pb2.TokenizeRequest(text=MIB4)
    # The answer (every id and its token's text) is far over gRPC's default 4 MiB for a received message.
    with grpc.insecure_channel(stack.address, options=[("grpc.max_receive_message_length", 256 * 2**20)]) as channel:
        tokenize = inference_pb2_grpc.InferenceStub(channel).Tokenize
        answer, statuses = while_asking(stack.http_url, lambda: tokenize(request, timeout=HANG_GUARD_S))
    assert answer.count > 100_000 and len(answer.token_ids) == len(answer.tokens) == answer.count
    assert answer.max_model_len == 512
    assert statuses and set(statuses) == {200}, statuses
