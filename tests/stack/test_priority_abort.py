"""Priority and abort by id on the real three-process stack (tiny model): a later request with
a higher priority (lower value) gets its first token before earlier lower-priority ones still
waiting; `Inference.Abort` from a second connection ends a stream (gRPC or HTTP) with ABORT and
leaves no block used; unknown ids come back in not_found."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_infer.bench.harness import Stack, pool, run_stack, wait_for_idle

pytestmark = pytest.mark.slow
LONG = 2000  # tokens: long enough to still run while the test acts


def request(max_tokens: int, request_id: str, priority: int = 0) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=request_id, priority=priority,
                                         prompt_token_ids=inference_pb2.TokenIds(ids=[5, 6, 7, 8]),
                                         params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))


@pytest.fixture(scope="module")
def stack(long_context_llama_dir: Path):
    # One sequence runs at a time: everything else waits in the queue, in priority order.
    with run_stack(long_context_llama_dir, "--max-model-len", "4096", "--max-num-seqs", "1",
                   "--log-level", "warning") as s:
        yield s


def wait_waiting(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 30
    while pool(stack).num_waiting < count:
        assert time.monotonic() < deadline, f"{pool(stack).num_waiting} waiting, expected {count}"
        time.sleep(0.02)


def abort(stack: Stack, *ids: str) -> inference_pb2.AbortGenerationResponse:
    """Abort from a connection of its own: the caller need not hold the stream."""
    with grpc.insecure_channel(stack.address) as channel:
        return inference_pb2_grpc.InferenceStub(channel).Abort(
            inference_pb2.AbortGenerationRequest(request_ids=list(ids)), timeout=30)


def test_higher_priority_request_is_admitted_before_earlier_lower_ones(stack: Stack) -> None:
    busy = stack.inference.Generate(request(LONG, "busy"))
    next(busy)  # it holds the only slot
    first_token: list[str] = []
    lock = threading.Lock()

    def run(rid: str, priority: int) -> None:
        for message in stack.inference.Generate(request(8, rid, priority), timeout=120):
            if message.token_ids:
                with lock:
                    if rid not in first_token:
                        first_token.append(rid)

    threads = []
    for i in range(3):  # earlier, lower priority (higher value)
        threads.append(threading.Thread(target=run, args=(f"low-{i}", 5)))
        threads[-1].start()
        wait_waiting(stack, i + 1)
    threads.append(threading.Thread(target=run, args=("high", -2)))
    threads[-1].start()
    wait_waiting(stack, 4)
    busy.cancel()
    for t in threads:
        t.join(120)
    assert first_token == ["high", "low-0", "low-1", "low-2"]
    assert wait_for_idle(stack).used_blocks == 0


def test_abort_from_a_second_connection_ends_the_stream_with_abort(stack: Stack) -> None:
    call = stack.inference.Generate(request(LONG, "abort-me"))
    first = next(call)
    assert first.token_ids and pool(stack).used_blocks > 0
    answer = abort(stack, "abort-me", "no-such-request")
    assert list(answer.aborted) == ["abort-me"] and list(answer.not_found) == ["no-such-request"]
    rest = list(call)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in [first, *rest]) < LONG
    assert rest[-1].usage.completion_tokens == sum(len(m.token_ids) for m in [first, *rest])
    idle = wait_for_idle(stack)
    assert (idle.used_blocks, idle.num_running, idle.num_waiting) == (0, 0, 0)


def test_abort_of_a_queued_request_and_of_unknown_ids(stack: Stack) -> None:
    busy = stack.inference.Generate(request(LONG, "busy-2"))
    next(busy)
    queued = stack.inference.Generate(request(LONG, "queued"))
    wait_waiting(stack, 1)
    answer = abort(stack, "queued", "", "x" * 500, "queued")  # repeats count once; empty/over-long ids name nothing
    assert list(answer.aborted) == ["queued"] and list(answer.not_found) == ["", "x" * 500]
    messages = list(queued)
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_ABORT and not any(m.token_ids for m in messages)
    assert pool(stack).num_waiting == 0
    assert list(abort(stack, "busy-2").aborted) == ["busy-2"]
    assert list(busy)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert list(abort(stack, "busy-2").not_found) == ["busy-2"]  # ended: not found any more
    assert wait_for_idle(stack).used_blocks == 0


def test_grpc_abort_ends_an_http_stream_by_its_request_id(stack: Stack) -> None:
    body = {"prompt": "the river", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as r:
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines))
        request_id = first["id"].removeprefix("cmpl-")  # the HTTP request id (X-Request-Id when sent)
        assert list(abort(stack, request_id).aborted) == [request_id]
        rest = list(lines)
    assert rest[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, rest[:-1]) if c["choices"]]
    assert finishes[-1] == "abort"
    assert wait_for_idle(stack).used_blocks == 0
