"""A large prompt delays only itself: refused before it is tokenized when it cannot fit, tokenized
off the gateway's event loop when it must be (/tokenize, gRPC Tokenize), and the gateway's memory
comes back after it. Measured from outside, on the real stack: a second client asks GET /v1/models
every 10 ms meanwhile, and its answers stay fast."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import psutil
import pytest

from hetero.v1 import inference_pb2, inference_pb2_grpc
from hetero_infer.testing.loop_lag import while_pinging
from hetero_infer.testing.stack import Stack, run_stack
from tests.helpers.raw_http import settled_rss

pytestmark = pytest.mark.slow
_rng = random.Random(0)
MIB4 = " ".join(_rng.choice(["alpha", "bravo", "delta", "echo", "golf", "kilo"]) for _ in range(4 * 2**20 // 6))  # 3.7 MiB: under the default body cap (4 MiB)
# The slowest answer a small request may get while the large one runs. The loop's own work on a
# 4 MiB body (JSON parsing) takes tens of milliseconds; a tokenization on the loop took seconds.
PING_MAX_S = 0.25


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    with run_stack(tiny_llama_dir) as s:
        httpx.post(f"{s.http_url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        yield s


def assert_memory_returns(process: psutil.Process, before: int) -> None:
    """The gateway's RSS comes back within 50 MiB of `before` (it trims its heap a second after a large input)."""
    grown = settled_rss(process, before) - before
    assert grown < 50 * 2**20, f"the gateway kept {grown >> 20} MiB"


def assert_responsive(latencies: list[float]) -> None:
    assert len(latencies) >= 3
    assert max(latencies) < PING_MAX_S, f"a small request waited {max(latencies):.3f} s (all: {sorted(latencies)[-5:]})"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(stack: Stack) -> None:
    gateway = stack.service_process("gateway")
    before = gateway.memory_info().rss
    with httpx.Client(timeout=60) as client:
        answer, seconds, latencies = while_pinging(
            stack.http_url, lambda: client.post(f"{stack.http_url}/v1/completions", json={"prompt": MIB4, "max_tokens": 1}))
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("prompt is at least ") and "max_model_len is 512" in message, message
    assert seconds < 1.0
    assert_responsive(latencies)
    assert_memory_returns(gateway, before)


def test_chat_messages_that_cannot_fit_are_refused_summed(stack: Stack) -> None:
    half = MIB4[: len(MIB4) // 2]
    body = {"messages": [{"role": "user", "content": half}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": half}], "max_tokens": 1}
    start = time.perf_counter()
    answer = httpx.post(f"{stack.http_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("prompt is at least ")
    assert time.perf_counter() - start < 1.0


def test_a_large_tokenize_runs_off_the_event_loop(stack: Stack) -> None:
    gateway = stack.service_process("gateway")
    before = gateway.memory_info().rss
    with httpx.Client(timeout=120) as client:
        answer, _, latencies = while_pinging(
            stack.http_url, lambda: client.post(f"{stack.http_url}/tokenize", json={"prompt": MIB4}))
    assert answer.status_code == 200
    assert answer.json()["count"] > 100_000
    del answer
    assert_responsive(latencies)
    assert_memory_returns(gateway, before)


def test_a_large_grpc_tokenize_runs_off_the_event_loop(stack: Stack) -> None:
    request = inference_pb2.TokenizeRequest(text=MIB4)
    # The answer (every id and its token's text) is far over gRPC's default 4 MiB for a received message.
    with grpc.insecure_channel(stack.address, options=[("grpc.max_receive_message_length", 256 * 2**20)]) as channel:
        tokenize = inference_pb2_grpc.InferenceStub(channel).Tokenize
        answer, _, latencies = while_pinging(stack.http_url, lambda: tokenize(request, timeout=120))
    assert answer.count > 100_000 and len(answer.token_ids) == answer.count
    assert_responsive(latencies)
