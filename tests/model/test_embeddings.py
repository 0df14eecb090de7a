"""Embeddings from the in-process engine against sentence-transformers on the same weights (float32, the tiny
Llama and Qwen2 with sentence-transformers' module files): every pooling, single inputs and batches of mixed
lengths, inputs longer than a prefill chunk, and inputs embedded in the same steps as generations, whose tokens
stay those they have alone. Oracle: cosine similarity of at least 0.99999 with the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import cosine, load_sentence_transformer, make_sentence_transformers_dir

MIN_COSINE = 0.99999
CHUNK = 16  # max_prefill_chunk_tokens: the long inputs take several steps
TEXTS = ["a", "hello world", "query: how many blocks does a 40-token prompt take?",
         "The quick brown fox jumps over the lazy dog. " * 12]  # the last: well over three chunks


@pytest.fixture(scope="module", params=["last", "mean", "cls"])
def embedding_dir(request, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, make_sentence_transformers_dir(tiny_llama_dir, tmp_path_factory.mktemp("st") / "m",
                                                         request.param)


def engine(model: Path, **overrides) -> InferenceEngine:
    return InferenceEngine(Config(model=str(model), device="cpu", dtype="float32", block_size=4,
                                  max_prefill_chunk_tokens=CHUNK, **overrides))


def test_batches_of_mixed_lengths_match_sentence_transformers(embedding_dir: tuple[str, Path]) -> None:
    pooling, model = embedding_dir
    reference = load_sentence_transformer(model).encode(TEXTS)
    eng = engine(model)  # the pooling is the model directory's (modules.json)
    assert len(eng.tokenizer.encode(TEXTS[-1])) > 3 * CHUNK
    batch = eng.embed(TEXTS)
    alone = [eng.embed([text])[0] for text in TEXTS]
    for text, got, one, want in zip(TEXTS, batch, alone, reference):
        assert cosine(got, want) >= MIN_COSINE, (pooling, text)
        assert cosine(one, want) >= MIN_COSINE, (pooling, text)
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-6
    stats = eng.get_memory_stats()
    assert stats.used_blocks == 0 and stats.prefix_cache_queries == 0  # freed, and the cache never consulted


def test_embeddings_in_the_same_steps_as_generations(embedding_dir: tuple[str, Path]) -> None:
    """Generations run while the inputs are embedded, their chunks in the same steps: the vectors are the
    reference's, and every generation's greedy tokens are those it makes alone."""
    pooling, model = embedding_dir
    reference = load_sentence_transformer(model).encode(TEXTS)
    eng = engine(model)
    alone = _generate(eng, [])
    plans = []
    execute = eng.runner.execute
    eng.runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]  # the real runner, its plans kept
    mixed = _generate(eng, TEXTS)
    generations, vectors = mixed[:len(PROMPTS)], mixed[len(PROMPTS):]
    assert {r.request_id: r.output_token_ids for r in generations} == {r.request_id: r.output_token_ids for r in alone}
    for vector, want in zip(vectors, reference):
        assert cosine(vector, want) >= MIN_COSINE, pooling
    pooled = {n.seq_id for p in plans for n in p.new_sequences if n.pooling}
    shared = [p for p in plans if len({s.seq_id in pooled for s in p.scheduled}) == 2]
    assert len(shared) >= 3, "embedding chunks did not share steps with generations"
    assert eng.get_memory_stats().used_blocks == 0


PROMPTS = [list(range(5, 5 + n)) for n in (3, 20, 41)]


def _generate(eng: InferenceEngine, texts: list[str]) -> list:
    """PROMPTS' greedy generations (CompletedRequest) submitted first, then `texts` embedded: the
    generations, then the vectors."""
    for i, p in enumerate(PROMPTS):
        eng.submit_request(p, GenerationParams(max_tokens=12, temperature=0, ignore_eos=True), request_id=f"g{i}")
    embedded = [eng.submit_embedding(text) for text in texts]
    done = sorted(eng.run(), key=lambda r: r.request_id)
    return done + [eng.take_embedding(rid) for rid in embedded]


def test_token_ids_and_a_qwen2_model(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """Token-id inputs against transformers' final-norm hidden states; a Qwen2 model (biased projections)."""
    from transformers import AutoModel

    model = make_sentence_transformers_dir(tiny_qwen2_dir, tmp_path / "q", "mean")
    hf = AutoModel.from_pretrained(str(model), dtype=torch.float32).eval()
    inputs = [[7], list(range(3, 40)), [11, 12, 13, 14, 15]]
    eng = engine(model)
    got = eng.embed(inputs, pooling="last", dimensions=16)
    with torch.no_grad():
        for ids, vector in zip(inputs, got):
            want = hf(torch.tensor([ids])).last_hidden_state[0, -1, :16]
            assert vector.shape == (16,) and cosine(vector, want.numpy()) >= MIN_COSINE
