"""Overlap through the whole stack (gateway, scheduler, worker: separate processes, the tiny model):
the same requests give the same streams with `async_scheduling` on and off, token for token, with
greedy and seeded sampling, stop ids that end sequences under a step planned ahead, n = 2, logprobs
and a tight batch, and no KV block is left in use."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from hetero.v1 import common_pb2, inference_pb2
from tests.helpers.oracle import make_prompts
from hetero_infer.bench.harness import pool, run_stack, wait_for_idle

slow = pytest.mark.slow


def requests(stop_id: int) -> list[inference_pb2.GenerateRequest]:
    prompts = make_prompts()
    variants = [
        dict(max_tokens=24, temperature=0.0, ignore_eos=True),
        dict(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id]),
        dict(max_tokens=3, temperature=0.0, ignore_eos=True),
        dict(max_tokens=30, temperature=0.9, seed=7, ignore_eos=True, logprobs=2),
        dict(max_tokens=20, temperature=0.8, seed=11, n=2, stop_token_ids=[stop_id]),
        dict(max_tokens=1, temperature=0.0),
        dict(max_tokens=35, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True, logprobs=1),
        dict(max_tokens=16, temperature=0.7, seed=3, top_k=5),
    ]
    return [inference_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=inference_pb2.TokenIds(ids=prompts[i]),
                                          params=common_pb2.SamplingParams(**v))
            for i, v in enumerate(variants)]


def stream_all(stack, reqs: list[inference_pb2.GenerateRequest]) -> dict[tuple[str, int], tuple]:
    out: dict[tuple[str, int], tuple] = {}

    def run(req: inference_pb2.GenerateRequest) -> None:
        per_index: dict[int, tuple[list[int], list[float], int]] = {}
        for m in stack.inference.Generate(req, timeout=120):
            tokens, logprobs, _ = per_index.get(m.index, ([], [], 0))
            tokens += m.token_ids
            logprobs += [round(lp.logprob, 4) for lp in m.logprobs]
            per_index[m.index] = (tokens, logprobs, m.finish_reason)
        for index, value in per_index.items():
            out[(req.request_id, index)] = value

    threads = [threading.Thread(target=run, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return out


@slow
def test_overlap_gives_the_same_streams_as_one_step_at_a_time(tiny_llama_dir: Path) -> None:
    results = {}
    stop_id = None
    for overlap in ("false", "true"):
        with run_stack(tiny_llama_dir, "--async-scheduling", overlap, "--max-batch-size", "4", "--block-size", "4") as stack:
            if stop_id is None:  # a token the greedy stream of prompt 1 produces mid-way
                probe = requests(0)[1]
                probe.params.ClearField("stop_token_ids")
                probe.params.ignore_eos = True
                stop_id = [t for m in stack.inference.Generate(probe, timeout=60) for t in m.token_ids][6]
            results[overlap] = stream_all(stack, requests(stop_id))
            idle = wait_for_idle(stack)
            assert idle.used_blocks == 0
            ahead = pool(stack).steps_planned_ahead
            assert (ahead > 0) == (overlap == "true"), ahead
            metrics = httpx.get(f"{stack.http_url}/metrics", timeout=10).text
            assert f"hetero_engine_steps_planned_ahead {float(ahead)}" in metrics
    assert len(results["true"]) == 9  # 8 requests, one with n = 2
    assert results["true"][("r1", 0)][2] == common_pb2.FINISH_REASON_STOP  # ended by the stop id, unforeseen
    assert results["true"] == results["false"]
