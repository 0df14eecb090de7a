"""Config `quantization`: what is not served is refused naming the key, never quietly dequantized; fp8 weights
served on the CPU through torch's reference `_scaled_mm` (the host side of CUDA's fp8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import make_random_llama
from kernels import fp8_linear
from kernels.fp8_linear import Fp8Weight
from tests.helpers.prompt_logits import engine_prompt_logits, prompt_logits


def test_an_unknown_quantization_is_refused_at_validation() -> None:
    with pytest.raises(ConfigError, match="'quantization'.*must be auto, none, int8 or fp8"):
        Config(quantization="fp4").validate()


def test_int8_without_its_kernel_path_is_refused_at_start(tmp_path: Path) -> None:
    """float32 runs the torch code, which has no int8 products: the worker says so instead of serving float32."""
    model = make_random_llama(tmp_path / "llama", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, seed=2)
    with pytest.raises(ConfigError, match="'quantization' = 'int8' cannot be served"):
        InferenceEngine(Config(model=str(model), dtype="float32", quantization="int8").validate())


@pytest.mark.skipif(fp8_linear.unavailable_reason(torch.device("cpu"), torch.bfloat16) is not None,
                    reason="torch._scaled_mm does not run on this CPU build")
def test_fp8_weights_serve_on_the_cpu_through_torchs_scaled_mm(tmp_path: Path) -> None:
    """The host side of CUDA's fp8 serving, run on the CPU: every layer's linear weight in fp8 (the LM head
    not), logits close to bfloat16's, tokens generated."""
    model = make_random_llama(tmp_path / "llama", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, seed=4)
    bf16 = InferenceEngine(Config(model=str(model), dtype="bfloat16", block_size=16).validate())
    fp8 = InferenceEngine(Config(model=str(model), dtype="bfloat16", block_size=16, quantization="fp8").validate())
    layer = fp8.runner.model.layers[0]
    assert all(type(layer[name]) is Fp8Weight for name in ("qkv", "o", "gate_up", "down"))
    assert type(fp8.runner.model.lm_head) is not Fp8Weight
    prompt = list(range(3, 40))
    a, b = engine_prompt_logits(fp8, prompt)[-1], engine_prompt_logits(bf16, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    fp8.submit_request(prompt, GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    (result,) = fp8.run()
    assert len(result.output_token_ids) == 8


def test_cudas_int8_products_serve_a_model_run_on_the_cpu(tmp_path: Path) -> None:
    """`quantization: int8` on CUDA is W8A8 through torch._int_mm (kernels/int8_linear.py); its host side, run
    here on the CPU's _int_mm: every layer's linear weight in int8 (the LM head not), logits close to
    bfloat16's."""
    from gpu_worker.models.checkpoint import load_checkpoint
    from gpu_worker.models.model import LlamaModel
    from kernels.attention_backend import create_attention_backend
    from kernels.int8_linear import Int8Weight

    directory = make_random_llama(tmp_path / "llama", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                                  seed=5)
    config, weights = load_checkpoint(directory)
    prompt = list(range(3, 40))
    out = {}
    for w8a8 in (False, True):
        model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, 64, int8_w8a8=w8a8)
        attention = create_attention_backend("torch", model.num_heads, model.num_kv_heads, config.head_dim, "cpu",
                                             torch.bfloat16)
        out[w8a8] = prompt_logits(model, attention, torch.bfloat16, prompt)
        if w8a8:
            assert all(type(model.layers[0][n]) is Int8Weight for n in ("qkv", "o", "gate_up", "down"))
            assert type(model.lm_head) is not Int8Weight
    assert not torch.equal(out[True], out[False])
    assert torch.nn.functional.cosine_similarity(out[True].flatten(), out[False].flatten(), dim=0) > 0.99
