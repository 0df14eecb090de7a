"""Tensor parallel 2 on the CPU (gloo): the same greedy token ids as tensor parallel 1, also
across a KV-cache suspend/resume, which every rank carries out."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.helpers.oracle import NEW_TOKENS, engine_greedy, make_prompts
from hetero_infer.bench.harness import free_port, run_stack, wait_for_idle
from tests.helpers.stack_requests import generate_concurrently, start_streams_to_suspend

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "qwen2_moe"])
def test_tp2_stack_matches_tp1(model_fixture: str, request: pytest.FixtureRequest) -> None:
    """Also a mixture of experts with a shared expert: each expert and the shared one split along their
    intermediate features, the router and the shared expert's gate whole on both ranks."""
    model_dir: Path = (request.getfixturevalue("tiny_moe_dirs")[model_fixture] if model_fixture == "qwen2_moe"
                       else request.getfixturevalue(model_fixture))
    prompts = make_prompts()
    tp1 = engine_greedy(model_dir, prompts, block_size=5)  # tensor parallel 1 (the transformers-checked path)
    worker = f"127.0.0.1:{free_port()}"
    with run_stack(model_dir, "--block-size", "5", "--max-model-len", "512", "--tensor-parallel-size", "2",
                   "--worker-address", worker, "--log-level", "warning") as stack:
        assert generate_concurrently(stack, prompts, NEW_TOKENS, 120) == tp1
        assert wait_for_idle(stack).used_blocks == 0
        info = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest())
        assert info.service.num_workers_up == 1
        with grpc.insecure_channel(worker) as channel:
            described = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert described.tensor_parallel_size == 2 and described.pid > 0


@pytest.mark.parametrize("mode", ["OFFLOAD", "RECOMPUTE"])
def test_tp2_suspend_releases_every_rank_and_streams_continue(tiny_llama_dir: Path, mode: str) -> None:
    prompts = make_prompts()
    tp1 = engine_greedy(tiny_llama_dir, prompts[6:8], block_size=16)
    # 32,768 blocks x 4 KiB per rank (2 layers x K/V x 16 slots x 1 KV head x 16 dims x fp32): 128 MiB a rank.
    block_bytes, num_blocks = 2 * 2 * 16 * 1 * 16 * 4, 32768
    scheduler_address = f"127.0.0.1:{free_port()}"
    results: dict[int, list[int]] = {}
    with run_stack(tiny_llama_dir, "--block-size", "16", "--max-num-blocks", str(num_blocks), "--max-model-len", "512",
                   "--tensor-parallel-size", "2", "--scheduler-address", scheduler_address,
                   "--log-level", "warning") as stack:
        follower = stack.service_process("worker", tp_rank=1)
        threads = start_streams_to_suspend(stack, results)
        with grpc.insecure_channel(scheduler_address) as channel:
            scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
            answer = scheduler.Suspend(scheduler_pb2.SuspendRequest(
                mode=common_pb2.KVCacheManagementMode.Value(f"KV_CACHE_MANAGEMENT_MODE_{mode}")), timeout=60)
            # Both ranks' shards, each reported by the rank that dropped it: the memory goes back as each drops
            # its cache (no reference is left: tests/unit/gpu_worker/test_kv_suspension.py).
            assert answer.released_bytes == 2 * num_blocks * block_bytes
            assert follower.is_running()
            scheduler.Resume(scheduler_pb2.ResumeRequest(), timeout=60)
        for t in threads:
            t.join(150)
        assert results[6] == tp1[0]
        assert len(results[7]) == 200 and results[7][:NEW_TOKENS] == tp1[1]
        assert wait_for_idle(stack).used_blocks == 0


def test_tp2_with_a_draft_model_matches_tp1(tiny_llama_dir: Path) -> None:
    """Speculative decoding with a draft model under tensor parallelism: every rank runs the whole draft and
    verifies rank 0's proposals; the served model as its own draft keeps them, and the tokens are TP 1's."""
    prompts = make_prompts()
    tp1 = engine_greedy(tiny_llama_dir, prompts, block_size=5)
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512", "--tensor-parallel-size", "2",
                   "--worker-address", f"127.0.0.1:{free_port()}", "--log-level", "warning",
                   "--speculative-method", "draft", "--speculative-model", str(tiny_llama_dir),
                   "--num-speculative-tokens", "3", "--speculative-adaptive", "false") as stack:
        assert generate_concurrently(stack, prompts, NEW_TOKENS, 120) == tp1
        stats = wait_for_idle(stack)
        assert stats.used_blocks == 0 and 0 < stats.spec_accepted_tokens == stats.spec_draft_tokens
