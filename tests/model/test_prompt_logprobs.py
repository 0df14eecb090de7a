"""Prompt logprobs through the real Scheduler and ModelRunner (in process, float32) against
`transformers`' float32 log_softmax on the same tiny checkpoint: whole prompts, prompts split
over several steps, a warm prefix cache (skipped), a recompute before the first token, n > 1.
The stack-level tests (gRPC, HTTP echo, vLLM's extension) are in test_prompt_logprobs_stack.py."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from gateway.openai import schema as oa
from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from hetero_common.errors import ValidationError
from hetero_common.sampling import validate
from scheduler_svc.core.prompt_logprobs import PromptLogprobs
from scheduler_svc.core.scheduler import Scheduler, TokenOutput
from tests.helpers.oracle import make_prompts

TOLERANCE = 1e-4
slow = pytest.mark.slow  # a model and the oracle per test: seconds each


class Engine:
    """A Scheduler and a ModelRunner, stepped by hand; keeps every output and worker result."""

    def __init__(self, model_dir: Path, **overrides) -> None:
        config = Config(model=str(model_dir), **{"dtype": "float32", "block_size": 4, **overrides}).validate()
        self.runner = ModelRunner(config)
        info = self.runner.describe()
        self.scheduler = Scheduler(config, info.num_blocks, tuple(info.eos_token_ids), 512)
        self.outputs: list[TokenOutput] = []
        self.results: list[worker_pb2.StepResult] = []

    def add(self, request_id: str, prompt: list[int], prompt_logprobs: int | None, **kw) -> None:
        params = common_pb2.SamplingParams(**{"max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **kw})
        if prompt_logprobs is not None:
            params.prompt_logprobs = prompt_logprobs
        self.scheduler.add_request(request_id, prompt, params)

    def step(self) -> None:
        result = self.runner.execute(self.scheduler.schedule())
        self.results.append(result)
        self.outputs += self.scheduler.process_result(result)

    def run(self) -> None:
        while self.scheduler.has_pending_work():
            self.step()
        assert self.scheduler.kv_cache.num_used == 0

    def first(self, request_id: str, index: int = 0) -> TokenOutput:
        return next(o for o in self.outputs if o.request_id == request_id and o.index == index)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_log_softmax(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches(model, prompt: list[int], out: TokenOutput, num_top: int) -> None:
    reference = hf_log_softmax(model, prompt)[:-1]
    chosen = reference.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    assert torch.allclose(torch.tensor(out.prompt_logprobs), chosen, atol=TOLERANCE)
    assert len(out.prompt_top_logprobs) == len(prompt) - 1
    values, ids = reference.topk(num_top, dim=-1) if num_top else (None, None)
    for p, top in enumerate(out.prompt_top_logprobs):
        assert len(top.token_ids) == num_top
        if num_top:
            assert list(top.token_ids) == ids[p].tolist()
            assert torch.allclose(torch.tensor(list(top.logprobs)), values[p], atol=TOLERANCE)


@slow
@pytest.mark.parametrize("chunk", [0, 3, 16])
def test_prompt_logprobs_match_transformers_whole_and_chunked(tiny_llama_dir: Path, hf_model, chunk: int) -> None:
    """chunk 0: each prompt in one step; 3 and 16: prompts split over several steps."""
    eng = Engine(tiny_llama_dir, max_prefill_chunk_tokens=chunk, max_total_tokens=64 if chunk else 4096)
    prompts = make_prompts(vocab=512)
    for i, prompt in enumerate(prompts):
        eng.add(f"r{i}", prompt, prompt_logprobs=[0, 1, 5][i % 3])
    eng.add("plain", prompts[-1], None)  # a row without prompt logprobs shares the steps
    eng.run()
    steps_per_prompt = [sum(1 for r in eng.results for e in r.prompt_logprobs if e.seq_id == i) for i in range(len(prompts))]
    if chunk == 3:
        assert max(steps_per_prompt) > 5  # the 50-token prompt came in many pieces
    for i, prompt in enumerate(prompts):
        assert_matches(hf_model, prompt, eng.first(f"r{i}"), [0, 1, 5][i % 3])
        later = [o for o in eng.outputs if o.request_id == f"r{i}"][1:]
        assert all(not o.prompt_logprobs for o in later)  # on the first event only
    assert not eng.first("plain").prompt_logprobs
    assert not [e for r in eng.results for e in r.prompt_logprobs if e.seq_id == len(prompts)]  # never computed


@slow
def test_warm_prefix_cache_is_not_used_by_prompt_logprobs(tiny_llama_dir: Path, hf_model) -> None:
    eng = Engine(tiny_llama_dir, max_prefill_chunk_tokens=8)
    prompt = make_prompts(vocab=512, seed=3)[-1]  # 50 tokens, 12 full blocks
    eng.add("cold", prompt, None)
    eng.run()
    eng.add("echo", prompt, prompt_logprobs=2)
    eng.run()
    assert eng.first("cold").cached_prompt_tokens == 0
    assert eng.first("echo").cached_prompt_tokens == 0  # the warm cache was not taken: no logits there
    assert_matches(hf_model, prompt, eng.first("echo"), 2)
    eng.add("warm", prompt, None)  # the echo request's blocks were registered for others
    eng.run()
    assert eng.first("warm").cached_prompt_tokens == 48
    stats = eng.scheduler.pool_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (100, 48)  # the echo's skipped lookup not counted


@slow
@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_suspend_before_the_first_token_neither_duplicates_nor_loses(tiny_llama_dir: Path, hf_model, mode: str) -> None:
    """A recompute restarts the prefill: positions already scored are scored again and land on
    the same places; an offload keeps the worker's state and the prefill goes on."""
    eng = Engine(tiny_llama_dir, max_prefill_chunk_tokens=6)
    prompt = make_prompts(vocab=512, seed=4)[-1]
    eng.add("a", prompt, prompt_logprobs=3)
    for _ in range(3):
        eng.step()
    assert not eng.outputs  # still in prefill
    eng.scheduler.suspend(mode)
    eng.runner.suspend_kv_cache(mode)
    eng.runner.resume_kv_cache()
    eng.scheduler.resume()
    eng.run()
    scored = [e.first_position for r in eng.results for e in r.prompt_logprobs]
    assert scored.count(1) == (2 if mode == "recompute" else 1)
    assert_matches(hf_model, prompt, eng.first("a"), 3)


@slow
def test_small_pool_preemptions_keep_prompt_logprobs_whole(tiny_llama_dir: Path, hf_model) -> None:
    eng = Engine(tiny_llama_dir, max_num_blocks=20, memory_threshold=1.0, max_prefill_chunk_tokens=5)
    prompts = make_prompts(vocab=512, seed=7)[3:]
    for i, prompt in enumerate(prompts):
        eng.add(f"r{i}", prompt, prompt_logprobs=1, max_tokens=30)
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    scored = collections.Counter((e.seq_id, e.first_position) for r in eng.results for e in r.prompt_logprobs)
    assert max(scored.values()) > 1  # some prompt was preempted mid-prefill and scored again
    for i, prompt in enumerate(prompts):
        assert_matches(hf_model, prompt, eng.first(f"r{i}"), 1)


@slow
def test_n3_only_sample_0_carries_them_and_forks_score_nothing(tiny_llama_dir: Path, hf_model) -> None:
    eng = Engine(tiny_llama_dir, max_prefill_chunk_tokens=7)
    prompt = make_prompts(vocab=512, seed=8)[-2]
    eng.add("n3", prompt, prompt_logprobs=2, n=3)
    eng.run()
    assert_matches(hf_model, prompt, eng.first("n3", 0), 2)
    for index in (1, 2):
        assert not eng.first("n3", index).prompt_logprobs and not eng.first("n3", index).prompt_top_logprobs
    sample0 = eng.scheduler._next_seq_id - 3  # the forks' seq ids follow sample 0's
    assert {e.seq_id for r in eng.results for e in r.prompt_logprobs} == {sample0}


@slow
def test_one_token_prompt_has_no_prompt_logprobs(tiny_llama_dir: Path) -> None:
    eng = Engine(tiny_llama_dir)
    eng.add("one", [42], prompt_logprobs=4)
    eng.run()
    first = eng.first("one")
    assert first.prompt_logprobs == [] and first.prompt_top_logprobs == [] and first.token_ids


def test_entries_file_by_position() -> None:
    """The scheduler's store: a chunk scored twice (after a recompute) overwrites, in any order."""
    store = PromptLogprobs(prompt_len=6)
    chunk = worker_pb2.PromptLogprobs(first_position=3, logprobs=[-1.0, -2.0], num_top=1, top_token_ids=[7, 8],
                                      top_logprobs=[-0.5, -0.6])
    store.add(chunk)
    store.add(worker_pb2.PromptLogprobs(first_position=1, logprobs=[-3.0, -4.0]))
    store.add(chunk)
    store.add(worker_pb2.PromptLogprobs(first_position=5, logprobs=[-5.0]))
    values, top = store.take("r")
    assert values == [-3.0, -4.0, -1.0, -2.0, -5.0] and not store.missing
    assert list(top[2].token_ids) == [7] and list(top[3].logprobs) == pytest.approx([-0.6])


def test_http_bodies_ask_the_engine_for_prompt_logprobs(tmp_path: Path) -> None:
    """echo + logprobs N and vLLM's prompt_logprobs M ask for max(N, M) alternatives; echo with
    max_tokens 0 asks for the prompt's own logprobs (the engine's scoring-only mode)."""
    from hetero_common.tokenizer import load_tokenizer
    from hetero_infer.bench.harness import make_tokenizer

    make_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)

    def asked(**body) -> int | None:
        params = oa.completion_requests(oa.CompletionBody(prompt="a", **body), "r", tokenizer)[0].params
        return params.prompt_logprobs if params.HasField("prompt_logprobs") else None

    assert asked(echo=True) is None and asked(logprobs=3) is None
    assert asked(echo=True, logprobs=3) == 3 and asked(echo=True, logprobs=1, prompt_logprobs=4) == 4
    assert asked(echo=True, max_tokens=0) == 0 and asked(prompt_logprobs=2) == 2
    chat = oa.chat_request(oa.ChatBody(messages=[{"role": "user", "content": "hi"}], prompt_logprobs=5), "c", tokenizer)
    assert chat.params.prompt_logprobs == 5


def test_max_tokens_0_only_with_prompt_logprobs_and_at_most_20_alternatives() -> None:
    validate(common_pb2.SamplingParams(max_tokens=0, prompt_logprobs=0))
    with pytest.raises(ValidationError, match="max_tokens"):
        validate(common_pb2.SamplingParams(max_tokens=0))
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        validate(common_pb2.SamplingParams(prompt_logprobs=21))
