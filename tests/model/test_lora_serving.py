"""Many LoRA adapters over one base model, per request, in one batch (issue 41), on the in-process engine:
in float32, greedy tokens equal PEFT's on `transformers` with the same base weights and adapter (ranks 8 and
64, different target sets, rsLoRA), and a batch that mixes the adapters and the base gives every sequence
what it gets alone; adapters never share prefix-cache blocks; no block is left in use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_common.config import Config
from hetero_common.errors import ModelNotFoundError
from hetero_infer.engine import GenerationParams, InferenceEngine
from gpu_worker.cpu.worker_setup import row_invariance_unavailable
from hetero_infer.bench.harness import make_random_llama
from tests.helpers.tiny_models import make_lora_adapter
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts

ADAPTERS = {  # name -> (rank, targets, rsLoRA)
    "attn8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp64": (64, ["gate_proj", "up_proj", "down_proj"], True),
    "all16": (16, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"], False),
}
GREEDY = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_lora_adapter(tiny_llama_dir, root / name, rank, targets, seed=i, rslora=rslora)
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy tokens of PEFT's model (the adapter over `transformers`' base), one prompt at a time."""
    if adapter is None:
        return hf_greedy(base, prompts, new_tokens)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter)).eval()
    # EOS neither stops nor is suppressed (min_new_tokens would mask it): ignore_eos's meaning, as in hf_greedy.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def engine(base: Path, adapters: dict[str, Path], **overrides) -> InferenceEngine:
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return InferenceEngine(Config(model=str(base), **{"dtype": "float32", "lora_modules": modules,
                                                      **overrides}).validate())


def test_a_batch_mixing_adapters_and_the_base_gives_each_what_peft_gives(tiny_llama_dir: Path, adapters) -> None:
    prompts = make_prompts()[:8]
    eng = engine(tiny_llama_dir, adapters, block_size=5)
    choice = ["", *ADAPTERS]
    ids = [(eng.submit_request(p, GREEDY, lora=choice[i % 4]), choice[i % 4]) for i, p in enumerate(prompts)]
    done = {r.request_id: r.output_token_ids for r in eng.run()}
    for name in choice:
        mine = [i for i, (_, n) in enumerate(ids) if n == name]
        expected = peft_greedy(tiny_llama_dir, adapters.get(name), [prompts[i] for i in mine])
        assert [done[ids[i][0]] for i in mine] == expected, name or "base"
    assert eng.get_memory_stats().used_blocks == 0


def test_the_same_prompt_under_each_adapter_shares_no_cached_block(tiny_llama_dir: Path, adapters) -> None:
    """With prefix caching on, the same prompt served by the base and by each adapter, one after another:
    each gets its own tokens (a block computed under one adapter is never reused under another)."""
    prompt = make_prompts()[1] * 3
    eng = engine(tiny_llama_dir, adapters, block_size=4)
    outputs = {}
    for name in ["", *ADAPTERS, ""]:
        rid = eng.submit_request(prompt, GREEDY, lora=name)
        outputs.setdefault(name, []).append(next(r for r in eng.run() if r.request_id == rid).output_token_ids)
    for name in ADAPTERS:
        assert outputs[name][0] == peft_greedy(tiny_llama_dir, adapters[name], [prompt])[0]
    assert outputs[""][0] == outputs[""][1] == hf_greedy(tiny_llama_dir, [prompt])[0]
    assert eng.get_memory_stats().used_blocks == 0


def test_preemption_and_n_2_keep_each_sequences_adapter(tiny_llama_dir: Path, adapters) -> None:
    prompts = make_prompts()[:6]
    eng = engine(tiny_llama_dir, adapters, block_size=4, max_num_blocks=20, memory_threshold=1.0,
                 preemption_mode="swap")
    ids = [eng.submit_request(p, GREEDY, lora="all16") for p in prompts]
    forked = eng.submit_request(prompts[0], GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                             n=2), lora="mlp64")
    results = eng.run()
    done = {r.request_id: r.output_token_ids for r in results if r.request_id != forked}
    assert [done[i] for i in ids] == peft_greedy(tiny_llama_dir, adapters["all16"], prompts)
    samples = [r.output_token_ids for r in results if r.request_id == forked]
    assert samples == peft_greedy(tiny_llama_dir, adapters["mlp64"], [prompts[0]]) * 2
    assert eng.scheduler.num_preemptions > 0 and eng.get_memory_stats().used_blocks == 0


def test_an_unknown_adapter_is_not_found(tiny_llama_dir: Path, adapters) -> None:
    eng = engine(tiny_llama_dir, adapters)
    with pytest.raises(ModelNotFoundError, match="LoRA adapter 'nope' is not loaded; loaded: attn8, mlp64, all16"):
        eng.submit_request([1, 2, 3], GREEDY, lora="nope")


@pytest.mark.skipif(row_invariance_unavailable(64, 16) is not None,
                    reason=f"bfloat16 rows are not invariant here: {row_invariance_unavailable(64, 16)}")
def test_bfloat16_rows_get_the_same_tokens_mixed_or_alone(tmp_path: Path) -> None:
    """bfloat16 with `deterministic`, where the C kernels take every row (head size 64, blocks of 16; the
    whole-model C layers add each row's LoRA delta themselves): a batch mixing the adapters and the base gives
    every sequence the tokens it gets alone."""
    base = make_random_llama(tmp_path / "d64", hidden=256, intermediate=512, layers=3, heads=4, kv_heads=2,
                             max_position_embeddings=1024, scale=0.3, seed=5)
    loras = {name: make_lora_adapter(base, tmp_path / name, rank, targets, seed=i, rslora=rslora)
             for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}
    prompts = [p for seed in (0, 1) for p in make_prompts(seed=seed)]
    choice = ["", *ADAPTERS]
    eng = engine(base, loras, dtype="bfloat16", deterministic=True, block_size=16)
    ids = [eng.submit_request(p, GREEDY, lora=choice[i % 4]) for i, p in enumerate(prompts)]
    together = {r.request_id: r.output_token_ids for r in eng.run()}
    for i, prompt in enumerate(prompts):
        rid = eng.submit_request(prompt, GREEDY, lora=choice[i % 4])
        assert next(r for r in eng.run() if r.request_id == rid).output_token_ids == together[ids[i]], i
    assert eng.get_memory_stats().used_blocks == 0
