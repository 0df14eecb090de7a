"""Each model family beyond Llama's through the real stack (gateway, scheduler, two worker replicas), from its
Hugging Face directory and, for Phi-3, Gemma 3 and the mixtures of experts, a GGUF file of it: transformers' greedy tokens on the
seeded prompts, first as they are, then again with their blocks in the prefix cache, prompt
chunks of at most 16 tokens, a pool small enough to preempt (recompute), and one replica SIGKILLed mid-stream;
ListModels carries the family and its experts, and the pool the experts' load."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.gguf_writer import write_gguf
from hetero_infer.bench.harness import free_port, pool, run_stack, service_stats, wait_for_idle
from tests.helpers.oracle import hf_greedy, make_prompts
from tests.helpers.stack_requests import ids_request
from tests.stack.test_resilience import killer, run_streams, stack_flags, worker_pid

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
# (family, its fixture, experts, experts per token, served from a GGUF file of it)
FAMILIES = [("qwen3", "tiny_qwen3_dir", 0, 0, False), ("phi3", "tiny_phi3_dir", 0, 0, False),
            ("phi3", "tiny_phi3_dir", 0, 0, True),
            ("gemma3", "tiny_gemma3_dir", 0, 0, False), ("gemma3", "tiny_gemma3_dir", 0, 0, True),
            ("mixtral", "mixtral", 4, 2, False), ("qwen3_moe", "qwen3_moe", 8, 3, False),
            ("qwen2_moe", "qwen2_moe", 4, 2, False), ("olmoe", "olmoe", 8, 2, False),
            ("mixtral", "mixtral", 4, 2, True), ("qwen3_moe", "qwen3_moe", 8, 3, True),
            ("qwen2_moe", "qwen2_moe", 4, 2, True), ("olmoe", "olmoe", 8, 2, True)]


def streams(prompts: list[list[int]]) -> list[inference_pb2.GenerateRequest]:
    params = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [inference_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=inference_pb2.TokenIds(ids=p),
                                          params=params) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family, fixture, experts, top_k, gguf", FAMILIES,
                         ids=[f[0] + "-gguf" * f[4] for f in FAMILIES])
def test_streams_match_transformers_through_cache_chunks_preemption_and_a_replica_loss(
        family: str, fixture: str, experts: int, top_k: int, gguf: bool, request: pytest.FixtureRequest,
        tiny_moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_moe_dirs[fixture] if experts else request.getfixturevalue(fixture)
    prompts = make_prompts()
    reference = {i: (tokens, None) for i, tokens in enumerate(hf_greedy(model, prompts, new_tokens=NEW_TOKENS))}
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    flags = stack_flags(addresses, "--restart-workers", "false", "--max-num-blocks", "24", "--memory-threshold", "1.0",
                        "--max-total-tokens", "16", "--preemption-mode", "recompute")
    flags[flags.index("--max-model-len") + 1] = "256"  # Phi-3's LongRoPE: its short factors, as transformers'
    served = model
    if gguf:  # the same weights as llama.cpp's converter writes them; the tokenizer from the directory
        served = write_gguf(model, tmp_path / f"{family}.gguf")
        flags += ["--tokenizer-path", str(model)]
    with run_stack(served, *flags) as stack:
        (card,) = stack.inference.ListModels(inference_pb2.ListModelsRequest()).models
        assert (card.architecture, card.num_experts, card.num_experts_per_tok) == (family, experts, top_k)
        assert run_streams(stack, streams=streams(prompts)) == reference
        # the longest prompt twice, one after the other: the second finds the first's blocks (the tiny pool may
        # have evicted those of the run above); the streams below then start with them cached
        for _ in range(2):
            stack.inference.Complete(ids_request(prompts[-1], 1), timeout=60)
        assert pool(stack).prefix_cache_hits > 0
        victim = worker_pid(addresses[1])
        on_progress, killed = killer(lambda: victim, after_tokens=len(prompts) * 8)
        assert run_streams(stack, on_progress, streams=streams(prompts)) == reference  # nothing lost or repeated
        assert killed.is_set()
        p, s = wait_for_idle(stack), service_stats(stack)
        assert (p.used_blocks, s.num_workers_up) == (0, 1)
        assert p.num_preemptions > 0 and s.num_recovered_sequences > 0
        # the experts' load as the workers routed it: every token (prompt and generated) to k experts per MoE layer
        assert len(p.expert_tokens) == experts and (sum(p.expert_tokens) > 0) == (experts > 0)
        if experts:  # the histogram: one observation per expert per step
            assert sum(p.expert_step_token_buckets) % experts == 0 and p.expert_step_tokens_sum == sum(p.expert_tokens)
