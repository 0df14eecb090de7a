"""The logits controls on real (tiny) models in the in-process engine: repetition penalty against
`transformers`' generate, mixed batches, n > 1 forks and recompute preemption.
The logits-level tests are in tests/unit/gpu_worker/test_logits_controls.py; gRPC through the stack in test_stack.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts

pytestmark = pytest.mark.slow
GREEDY = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PENALISED = dataclasses.replace(GREEDY, repetition_penalty=1.3)


def engine(model_dir: Path, **overrides) -> InferenceEngine:
    return InferenceEngine(Config(model=str(model_dir), **{"dtype": "float32", **overrides}).validate())


def run_all(eng: InferenceEngine, prompts: list[list[int]], params: list[GenerationParams]) -> list[list[list[int]]]:
    """Every request's samples' tokens (index order), submitted together."""
    ids = [eng.submit_request(p, q) for p, q in zip(prompts, params)]
    done: dict[str, dict[int, list[int]]] = {}
    for r in eng.run():
        done.setdefault(r.request_id, {})[r.index] = r.output_token_ids
    assert eng.get_memory_stats().used_blocks == 0
    return [[done[i][k] for k in sorted(done[i])] for i in ids]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_repetition_penalty_equals_transformers_generate(model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    prompts = make_prompts()
    new_tokens = 24  # long enough for the penalty to change the output
    reference = hf_greedy(model_dir, prompts, new_tokens, repetition_penalty=1.3)
    plain = hf_greedy(model_dir, prompts, new_tokens)
    assert reference != plain  # the penalty matters on these prompts
    params = [dataclasses.replace(PENALISED, max_tokens=new_tokens)] * len(prompts)
    assert [s[0] for s in run_all(engine(model_dir, block_size=4), prompts, params)] == reference
    # The same with a pool too small for the batch: sequences are preempted and recomputed.
    small = engine(model_dir, block_size=4, max_num_blocks=24, memory_threshold=1.0, preemption_mode="recompute")
    assert [s[0] for s in run_all(small, prompts, params)] == reference
    assert small.scheduler.num_preemptions > 0


def mixed_params() -> list[GenerationParams]:
    """Rows with and without controls, greedy and seeded random."""
    random = GenerationParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    return [
        dataclasses.replace(GREEDY, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4),
        dataclasses.replace(GREEDY, max_tokens=16),
        dataclasses.replace(random, presence_penalty=1.0, min_p=0.05, logit_bias={17: 3.0, 40: -100.0}),
        dataclasses.replace(random, top_p=0.9),
        dataclasses.replace(random, seed=9, frequency_penalty=-0.5, repetition_penalty=0.8, top_k=20),
        dataclasses.replace(GREEDY, max_tokens=16, logit_bias={100: 8.0}),
        dataclasses.replace(random, seed=3),
        dataclasses.replace(random, seed=4, n=2, frequency_penalty=1.0),  # forks carry their own counts
    ]


def test_a_mixed_batch_gives_each_row_what_it_gives_alone(tiny_llama_dir: Path) -> None:
    prompts, params = make_prompts()[:8], mixed_params()
    eng = engine(tiny_llama_dir, block_size=4)
    alone = [run_all(eng, [p], [q])[0] for p, q in zip(prompts, params)]
    together = run_all(eng, prompts, params)
    assert together == alone
    assert alone[0] != run_all(eng, [prompts[0]], [dataclasses.replace(GREEDY, max_tokens=16)])[0]  # controls acted
    assert alone[2] != run_all(eng, [prompts[2]], [GenerationParams(max_tokens=16, temperature=0.9, seed=5,
                                                                    ignore_eos=True)])[0]
    assert 40 not in alone[2][0] and alone[5][0] == [100] * 16  # banned; forced
    assert alone[7][0] != alone[7][1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_controls_survive_preemption(tiny_llama_dir: Path, mode: str) -> None:
    prompts, params = make_prompts()[:8], mixed_params()
    unpreempted = run_all(engine(tiny_llama_dir, block_size=4), prompts, params)
    eng = engine(tiny_llama_dir, block_size=4, max_num_blocks=20, memory_threshold=1.0, preemption_mode=mode)
    assert run_all(eng, prompts, params) == unpreempted
    assert eng.scheduler.num_preemptions > 0


def test_min_tokens_holds_back_stop_tokens_and_eos(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir, block_size=4)
    prompt = make_prompts()[4]
    free = run_all(eng, [prompt], [GREEDY])[0][0]
    stop = free[1]  # greedy decoding emits it second
    stopped = run_all(eng, [prompt], [dataclasses.replace(GREEDY, stop_token_ids=[stop])])[0][0]
    assert stopped == free[:free.index(stop) + 1]
    held = run_all(eng, [prompt], [dataclasses.replace(GREEDY, stop_token_ids=[stop], min_tokens=6)])[0][0]
    assert stop not in held[:6] and (held[-1] == stop or len(held) == NEW_TOKENS) and len(held) > 6
    # EOS: the model's own (ignore_eos off), banned until min_tokens, forced right after by logit_bias.
    eos = eng.runner.model_config.eos_token_ids[0]
    eos_params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, min_tokens=5, logit_bias={eos: 100.0})
    (out,) = run_all(eng, [prompt], [eos_params])[0]
    assert out[:5] != [eos] * 5 and eos not in out[:5] and out[5:] == [eos]
