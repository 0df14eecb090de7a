"""The correctness oracle: Hugging Face `transformers`' greedy output on a checkpoint, the seeded
prompts it is run on, and the in-process engine's greedy output to compare with it."""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_common.config import Config
from hetero_infer.bench.harness import PROMPT_LENGTHS, make_prompts  # noqa: F401 (re-exported)
from hetero_infer.engine import GenerationParams, InferenceEngine

NEW_TOKENS = 12  # what the correctness tests generate for each of the seeded prompts


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
              **generate_kwargs) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding), EOS not stopping it;
    `generate_kwargs` adds logits processors (e.g. repetition_penalty=1.3)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long), **generate_kwargs)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def hf_last_logits(model_dir: Path, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' float32 logits at each prompt's last position [len(prompts), vocab], one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


def engine_greedy(model_dir: Path, prompts: list[list[int]], **overrides) -> list[list[int]]:
    config = Config(model=str(model_dir), **{"dtype": "float32", **overrides}).validate()
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in prompts]
    done = {r.request_id: r for r in engine.run()}
    assert engine.get_memory_stats().used_blocks == 0
    return [done[i].output_token_ids for i in ids]
