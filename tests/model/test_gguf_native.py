"""The default model served from its Q4_1 GGUF blocks (config `quantization: auto`, issue 39) against the same
file dequantized and run in float32: the oracle's greedy agreement (tokens before the first divergence, at
least 90% of them), the weights held within 1.15x of the file's bytes for them, every layer in one C call."""

from __future__ import annotations

import gguf
import pytest

from gpu_worker.cpu.c_layers import GGUF_KIND_BASE
from hetero_common.config import Config
from hetero_common.model_files import default_model_path
from hetero_common.tokenizer import load_tokenizer
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import CHAT_PROMPTS as PROMPTS
from kernels.native import linear_gguf
from kernels.native.linear_gguf import GGUFPackedWeight

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not linear_gguf.supported(linear_gguf.Q4_1, 16, 32),
                                 reason="the GGUF kernel does not run here (AVX512-VNNI)")]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def native() -> InferenceEngine:
    return InferenceEngine(Config(block_size=16, quantization="auto").validate())


def test_the_blocks_are_what_the_model_holds(native: InferenceEngine) -> None:
    model = native.runner.model
    assert model.c_layers is not None and model.c_layers.kind == GGUF_KIND_BASE + linear_gguf.Q4_1
    held = [w for layer in model.layers for w in layer.values() if type(w) is GGUFPackedWeight] + [model.lm_head]
    assert all(type(w) is GGUFPackedWeight for w in held) and len(held) == 4 * 30 + 1
    assert model.embed is None and model.embed_blocks is model.lm_head  # the lookup reads the blocks too
    reader = gguf.GGUFReader(str(default_model_path()))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" and len(t.shape) == 2)
    file_bytes += int(next(t.n_bytes for t in reader.tensors if t.name == "token_embd.weight"))  # the tied head
    assert sum(w.packed.numel() for w in held) <= 1.15 * file_bytes


def test_greedy_agrees_with_the_dequantized_float32_run(native: InferenceEngine) -> None:
    tokenizer = load_tokenizer(default_model_path())
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(engine: InferenceEngine) -> list[list[int]]:
        ids = [engine.submit_request(p, params) for p in prompts]
        done = {r.request_id: r.output_token_ids for r in engine.run()}
        return [done[i] for i in ids]

    ours = run(native)
    reference = run(InferenceEngine(Config(block_size=16, dtype="float32", quantization="none").validate()))
    agreed = 0
    for a, b in zip(ours, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed += same
    assert agreed >= 0.9 * NEW_TOKENS * len(PROMPTS), (agreed, ours, reference)
