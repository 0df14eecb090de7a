"""serving.stream_interval through the real stack: a sample's first token comes alone, later ones in
messages of at least that many tokens (fewer only in the last), on gRPC and on HTTP's SSE, with the
same tokens and text as a stream of one token per message."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_common.tokenizer import load_tokenizer
from hetero_infer.bench.harness import Stack, run_stack, wait_for_idle
from tests.helpers.stack_requests import greedy

pytestmark = pytest.mark.slow
INTERVAL, NEW_TOKENS = 4, 15


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--serving-stream-interval", str(INTERVAL), "--log-level", "warning") as s:
        yield s


def test_grpc_stream_groups_tokens_after_the_first(stack: Stack) -> None:
    request = inference_pb2.GenerateRequest(prompt="Paris is the capital",
                                            params=greedy(NEW_TOKENS, track_generated_token_events=True))
    messages = list(stack.inference.Generate(request))
    sizes = [len(m.token_ids) for m in messages]
    assert sizes[0] == 1 and all(size >= INTERVAL for size in sizes[1:-1]) and sum(sizes) == NEW_TOKENS
    assert len(messages) <= 1 + -(-(NEW_TOKENS - 1) // INTERVAL)
    assert all(len(m.token_timestamps) == len(m.token_ids) for m in messages)
    assert messages[-1].usage.completion_tokens == NEW_TOKENS
    whole = stack.inference.Complete(request)
    assert "".join(m.text for m in messages) == whole.text
    assert [t for m in messages for t in m.token_ids] == list(whole.token_ids)
    assert wait_for_idle(stack).used_blocks == 0


def test_sse_stream_groups_tokens_after_the_first(stack: Stack) -> None:
    body = {"prompt": "Paris is the capital", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len(texts) <= 2 + -(-(NEW_TOKENS - 1) // INTERVAL)  # and perhaps an empty last chunk with the finish
    whole = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=60).json()
    assert "".join(texts) == whole["choices"][0]["text"]


def test_a_stop_string_ends_a_grouped_message_at_the_token_that_completes_it(stack: Stack, tiny_llama_dir: Path) -> None:
    whole = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="Paris is the capital", params=greedy(NEW_TOKENS)))
    tokenizer = load_tokenizer(tiny_llama_dir)
    texts = [tokenizer.decode(list(whole.token_ids[:k]), skip_special_tokens=True) for k in range(NEW_TOKENS + 1)]
    # a stop string that the 3rd to 10th token completes, with tokens after it in the same message
    k = next(k for k in range(3, 11) if len(texts[k].strip()) > len(texts[k - 1].strip()) >= 3)
    stop = texts[k].strip()[-3:]
    if stop in texts[k - 1]:
        pytest.skip("no stop string completed by one token found in this model's output")
    request = inference_pb2.GenerateRequest(prompt="Paris is the capital", params=greedy(NEW_TOKENS, stop=[stop]))
    messages = list(stack.inference.Generate(request))
    ids = [t for m in messages for t in m.token_ids]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP and messages[-1].stop_reason == stop
    assert ids == list(whole.token_ids[:k]) and messages[-1].usage.completion_tokens == k
    assert stop not in "".join(m.text for m in messages)


def test_samples_of_one_request_are_grouped_each_apart(stack: Stack) -> None:
    """n = 3 samples decode in the same steps, so their tokens reach the gateway interleaved; each sample's
    messages still group N tokens (the request's usage comes once, on its last message)."""
    n = 3
    request = inference_pb2.GenerateRequest(prompt="Paris is the capital",
                                            params=greedy(NEW_TOKENS, n=n, track_generated_token_events=True))
    messages = list(stack.inference.Generate(request))
    whole = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="Paris is the capital", params=greedy(NEW_TOKENS)))
    for index in range(n):
        mine = [m for m in messages if m.index == index]
        sizes = [len(m.token_ids) for m in mine if m.token_ids]
        assert sizes[0] == 1 and all(size >= INTERVAL for size in sizes[1:-1]) and sum(sizes) == NEW_TOKENS, sizes
        assert [t for m in mine for t in m.token_ids] == list(whole.token_ids)  # greedy: every sample the same
        assert "".join(m.text for m in mine) == whole.text
    assert len(messages) <= n * (1 + -(-(NEW_TOKENS - 1) // INTERVAL)) + 1
    assert wait_for_idle(stack).used_blocks == 0
