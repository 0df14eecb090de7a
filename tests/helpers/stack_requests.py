"""Requests that tests send to a running stack (the stack itself and its pool waits are in
hetero_infer/bench/harness.py, shared with the benchmarks)."""

from __future__ import annotations

import threading
import time

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import Stack, make_prompts
from tests.helpers.oracle import NEW_TOKENS


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def ids_request(ids: list[int], max_tokens: int, request_id: str = "", model: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=inference_pb2.TokenIds(ids=ids),
                                         params=greedy(max_tokens), model=model)


def start_streams_to_suspend(stack: Stack, results: dict[int, list[int]]) -> list[threading.Thread]:
    """Stream prompts 6 (NEW_TOKENS) and 7 (200 tokens, so it is still decoding at a suspend)
    into `results`; return once a sequence runs."""
    prompts = make_prompts()

    def run(i: int) -> None:
        results[i] = [t for m in stack.inference.Generate(ids_request(prompts[i], 200 if i == 7 else NEW_TOKENS),
                                                          timeout=120) for t in m.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in (6, 7)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool.num_running < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return threads


def generate_concurrently(stack: Stack, prompts: list[list[int]], max_tokens: int, timeout_s: float,
                          model: str = "") -> list[list[int] | None]:
    """Each prompt's greedy tokens, all streamed at once (one thread each); None where a stream did not finish.
    `model`: a LoRA adapter to serve them with ("" = the base model)."""
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        request = ids_request(prompts[i], max_tokens, model=model)
        results[i] = [t for m in stack.inference.Generate(request, timeout=timeout_s) for t in m.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return [results.get(i) for i in range(len(prompts))]
