"""Tensor parallel 2 on the CPU (gloo): the same greedy token ids as tensor parallel 1."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import grpc

from hetero.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import free_port, run_stack
from tests.test_correctness import NEW_TOKENS, engine_greedy, make_prompts
from tests.test_stack import ids_request, wait_for_idle

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tp2_stack_matches_tp1(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    tp1 = engine_greedy(model_dir, prompts, block_size=5)  # tensor parallel 1 (the transformers-checked path)
    results: dict[int, list[int]] = {}
    worker = f"127.0.0.1:{free_port()}"
    with run_stack(model_dir, "--block-size", "5", "--max-model-len", "512", "--tensor-parallel-size", "2",
                   "--worker-address", worker, "--log-level", "warning") as stack:
        def run(i: int) -> None:
            results[i] = [t for m in stack.inference.Generate(ids_request(prompts[i], NEW_TOKENS), timeout=120)
                          for t in m.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert [results[i] for i in range(len(prompts))] == tp1
        assert wait_for_idle(stack).used_blocks == 0
        info = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest())
        assert info.pool.num_workers_up == 1
        with grpc.insecure_channel(worker) as channel:
            described = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert described.tensor_parallel_size == 2 and described.pid > 0
