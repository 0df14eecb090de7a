"""The default model, SmolLM2-135M-Instruct from its GGUF file: real weights, real tokenizer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hetero_common.tokenizer import load_tokenizer
from hetero_common.config import Config
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_common.model_files import default_model_path
from hetero_infer.bench.harness import CHAT_PROMPTS, REPO_ROOT, run_stack

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


def test_gguf_greedy_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in CHAT_PROMPTS]
    engine = InferenceEngine(Config(block_size=16, dtype="float32").validate())
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in prompts]
    ours = {r.request_id: r.output_token_ids for r in engine.run()}

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    with torch.no_grad():
        for rid, prompt in zip(ids, prompts):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            assert ours[rid] == out[0, len(prompt):].tolist(), tokenizer.decode(prompt)


def test_demo_client_gets_paris_from_the_stack() -> None:
    with run_stack(None) as stack:
        out = subprocess.run([sys.executable, "examples/python_client.py", "--address", stack.address,
                              "What is the capital of France?"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout
