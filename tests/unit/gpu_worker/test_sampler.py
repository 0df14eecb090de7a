"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.sampling.sampler import SamplingBatch, sample
from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine


def batch(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seeds=None, index: int = 0) -> SamplingBatch:
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, seeds if seeds is not None else [None] * n,
                         [index] * n)


def test_greedy_and_degenerate_truncations_pick_the_argmax() -> None:
    logits = torch.randn(16, 100)
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, batch(16, temperature=0.0))[0], best)
    assert torch.equal(sample(logits, batch(16, top_k=1))[0], best)
    assert torch.equal(sample(logits, batch(16, top_p=1e-6))[0], best)


def test_top_k_and_top_p_only_draw_from_the_kept_set() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    tokens = sample(logits, batch(2000, top_k=3))[0]
    assert set(tokens.tolist()) == {0, 1, 2}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p 0.8 keeps tokens 0 and 1
    tokens = sample(logits, batch(2000, top_p=0.8))[0]
    assert set(tokens.tolist()) == {0, 1}
    assert probs[:2].sum() >= 0.8 > probs[0]


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(20000, 1)
    counts = torch.bincount(sample(logits, batch(20000))[0], minlength=3).float() / 20000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)
    sharp = torch.bincount(sample(logits, batch(20000, temperature=0.25))[0], minlength=3).float() / 20000
    assert sharp[0] > 0.85  # p^4 renormalized: 0.0625 / (0.0625 + 0.0081 + 0.0016) = 0.86


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.randn(4, 1000)
    a = sample(logits, batch(4, seeds=[7, 7, 8, None]))[0]
    b = sample(logits[[1, 0, 2, 3]], batch(4, seeds=[7, 7, 8, None]))[0]
    assert a[0] == b[1] and a[1] == b[0] and a[2] == b[2]
    # The next token of the same sequence draws fresh noise: over many steps the draws differ.
    flat = torch.zeros(1, 1000)
    draws = {int(sample(flat, batch(1, seeds=[7], index=i))[0]) for i in range(20)}
    assert len(draws) > 10


def test_same_seed_same_output_through_the_engine(tiny_llama_dir: Path) -> None:
    def run(seed: int, neighbours: int) -> list[int]:
        engine = InferenceEngine(Config(model=str(tiny_llama_dir), dtype="float32").validate())
        params = GenerationParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        rid = engine.submit_request([5, 6, 7], params)
        for i in range(neighbours):  # other traffic in the batch must not change a seeded stream
            engine.submit_request([9] * (i + 1), GenerationParams(max_tokens=20, temperature=1.0, ignore_eos=True))
        return {r.request_id: r.output_token_ids for r in engine.run()}[rid]

    first = run(1234, 0)
    assert run(1234, 3) == first
    assert run(4321, 0) != first


def test_the_widest_batch_samples_every_row_from_its_top_50() -> None:
    """What the CUDA warm-up measures the sampler's memory with: each row random, cut to its top 50 and top-p
    0.9 (the sort of the whole vocabulary), logprobs asked for."""
    from gpu_worker.sampling.sampler import widest_sampling_batch

    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    batch = widest_sampling_batch(6, torch.device("cpu"))
    tokens, logprobs = sample(logits, batch)
    top50 = logits.topk(50, dim=-1).indices
    assert all(int(t) in top50[i].tolist() for i, t in enumerate(tokens)) and logprobs is not None
    assert logprobs.shape == (6,)


def test_plain_greedy_is_a_batch_sample_answers_with_the_argmax_alone() -> None:
    """A CUDA graph step takes such a batch's tokens from its own argmax (gpu_worker/cuda/cuda_graphs.py)."""
    assert batch(4, temperature=0.0).plain_greedy
    assert not batch(4, temperature=0.5).plain_greedy
    mixed = batch(2, temperature=0.0)
    mixed.temperature[1] = 0.7
    assert not mixed.plain_greedy
    asks = batch(2, temperature=0.0)
    asks.want_logprobs = True
    assert not asks.plain_greedy
    logits = torch.randn(4, 50)
    tokens, logprobs = sample(logits, batch(4, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist() and logprobs is None
