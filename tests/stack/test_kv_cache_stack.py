"""KV cache depth through the real three-process stack: prefix-cache hits reported by
GetServerInfo and in usage, n > 1 samples streamed with their index (and Complete's
choices), and Scheduler.Suspend/Resume over gRPC in the middle of a stream."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts
from hetero_infer.bench.harness import Stack, free_port, run_stack, wait_for_idle
from tests.helpers.stack_requests import ids_request, start_streams_to_suspend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scheduler_address() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, scheduler_address: str):
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-model-len", "512", "--preemption-mode", "swap",
                   "--scheduler-address", scheduler_address) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, make_prompts())


def test_second_pass_hits_the_prefix_cache(stack: Stack, reference) -> None:
    prompt = make_prompts()[-1]  # 50 tokens: 12 full blocks of 4
    first = stack.inference.Complete(ids_request(prompt, NEW_TOKENS))
    second = stack.inference.Complete(ids_request(prompt, NEW_TOKENS))
    assert list(first.token_ids) == list(second.token_ids) == reference[-1]
    assert first.usage.cached_prompt_tokens == 0 and second.usage.cached_prompt_tokens == 48
    pool = wait_for_idle(stack)
    assert pool.prefix_cache_hits >= 48 and pool.prefix_cache_queries >= 100 and pool.cached_blocks > 0
    assert pool.used_blocks == 0 and 0.0 <= pool.internal_waste < 1.0


def test_n3_streams_three_indexed_samples(stack: Stack, reference) -> None:
    prompt = make_prompts()[5]
    request = ids_request(prompt, NEW_TOKENS)
    request.params.n = 3
    per_index: dict[int, list[int]] = {}
    finished = []
    for msg in stack.inference.Generate(request):
        per_index.setdefault(msg.index, []).extend(msg.token_ids)
        if msg.finish_reason:
            finished.append(msg.index)
    assert sorted(finished) == [0, 1, 2]
    assert per_index == {0: reference[5], 1: reference[5], 2: reference[5]}
    answer = stack.inference.Complete(request)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(list(c.token_ids) == reference[5] for c in answer.choices) and list(answer.token_ids) == reference[5]
    assert answer.usage.completion_tokens == 3 * NEW_TOKENS
    assert wait_for_idle(stack).used_blocks == 0


@pytest.mark.parametrize("mode", ["PERSIST", "OFFLOAD", "RECOMPUTE"])
def test_suspend_resume_over_grpc_mid_stream(stack: Stack, scheduler_address: str, reference, mode: str) -> None:
    results: dict[int, list[int]] = {}
    with grpc.insecure_channel(scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        threads = start_streams_to_suspend(stack, results)
        answer = scheduler.Suspend(scheduler_pb2.SuspendRequest(
            mode=common_pb2.KVCacheManagementMode.Value(f"KV_CACHE_MANAGEMENT_MODE_{mode}")))
        assert (answer.released_bytes > 0) == (mode != "PERSIST")
        pool = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool
        assert pool.suspended
        steps = pool.steps
        time.sleep(0.3)
        assert stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool.steps == steps  # paused
        scheduler.Resume(scheduler_pb2.ResumeRequest())
        for t in threads:
            t.join(60)
    assert results[6] == reference[6]
    assert len(results[7]) == 200 and results[7][:NEW_TOKENS] == reference[7]
    assert not wait_for_idle(stack).suspended
