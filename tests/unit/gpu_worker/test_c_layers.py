"""All decoder layers in one C call (gpu_worker/cpu/c_layers.py), and each layer's attention block in one C
call (the loop's path where the linear layers are oneDNN's), against the per-layer loop of the same
kernels: bitwise the same logits, on a prompt step and on a mixed step of decodes and a prompt chunk
with a cached prefix. The paths need head size 64 or 128 (the C attention's vector path), so these
tiny models have heads of 64; the one-call layers are skipped where the CPU cannot run the C linear kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu.c_layers import GGUF_KIND_BASE
from gpu_worker.cpu.worker_setup import cpu_flags
from gpu_worker.models.checkpoint import BLOCK_WEIGHTS, load_checkpoint
from gpu_worker.gguf_blocks import GGUFBlocks
from gpu_worker.models.model import LlamaModel
from hetero_infer.bench.harness import save_tiny_model  # with the tiny tokenizer
from kernels.cache_ops import allocate_kv_cache
from kernels.native import decode_attention as native_decode
from kernels.native import linear as native_linear
from kernels.native import linear_gguf
from kernels.native.linear_gguf import GGUFPackedWeight
from kernels.page_table import PageTable
from kernels.torch_attention import APART_MIN_ROWS, TorchPagedAttention

REASON = native_linear.unavailable_reason(cpu_flags())
pytestmark = pytest.mark.skipif(not native_decode.takes_prompts(64, 16),
                                reason="the C attention has no AVX512-BF16 path here")
BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def head64_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    common = dict(vocab_size=300, hidden_size=256, intermediate_size=320, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=0, tie_word_embeddings=False, torch_dtype="float32")
    if request.param == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5)).eval()
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, use_sliding_window=False)).eval()
        with torch.no_grad():  # biases that matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return save_tiny_model(model, tmp_path_factory.mktemp(f"head64-{request.param}"))


def two_steps(model: LlamaModel, config, path: str, prompts_apart: bool = False,
              tables: list[np.ndarray] | None = None, steps: list[tuple[np.ndarray, np.ndarray]] | None = None,
              num_blocks: int = 16) -> list[torch.Tensor]:
    """Step 1: two prompts (20 and 35 tokens). Step 2: the first decodes one token, the second gets a
    20-token chunk on top of its cached 35 (or the given page `tables` and `steps` of (q_lens, kv_lens), over
    a cache of `num_blocks`). Logits of each step's last rows. `path`: "c_layers" (every
    layer in one call, where the model has them), "block" (the loop, each attention block in one call) or
    "loop" (the loop with RoPE, the K/V write and attention as separate calls). `prompts_apart`: step 1's
    prompts (no cached prefix), and with the AMX kernel step 2's chunk, are left out of the C plan and attend
    apart (the AMX tile kernel, else SDPA), as on AMX CPUs."""
    saved = model.c_layers
    model.c_layers = saved if path == "c_layers" else None
    try:
        cache = allocate_kv_cache(config.num_hidden_layers, num_blocks, BLOCK, model.num_kv_heads, config.head_dim,
                                  torch.bfloat16, "cpu", TorchPagedAttention.kv_layout)
        attention = TorchPagedAttention(model.num_heads, model.num_kv_heads, config.head_dim, decode_kernel="c",
                                        dtype=torch.bfloat16, prompts_apart=prompts_apart)
        native_rows = attention.native_rows
        if path == "loop":  # the model then takes the separate calls (attention still runs its C plan)
            attention.native_rows = lambda: None  # type: ignore[method-assign]
        rng = np.random.default_rng(0)
        tables = tables or [np.array([3, 9], dtype=np.int32), np.array([5, 1, 12, 7], dtype=np.int32)]
        steps = steps or [(np.array([20, 35]), np.array([20, 35])), (np.array([1, 20]), np.array([21, 55]))]
        out = []
        with torch.inference_mode():
            for q_lens, kv_lens in steps:
                table = PageTable.build(tables, q_lens, kv_lens, BLOCK)
                attention.plan(table)
                assert native_rows() is not None  # the C paths' condition, whichever path runs
                if prompts_apart:  # prompts with no cached prefix, and (AMX kernel) the chunk over one
                    assert [n for _, n in attention.apart_prompts()] == [
                        n for n, kv in zip(q_lens, kv_lens) if n > 1 and (n == kv or attention._amx_prompts and n >= APART_MIN_ROWS)]
                positions, slots = table.token_positions()
                ids = torch.from_numpy(rng.integers(2, config.vocab_size, int(q_lens.sum())))
                rows = table.qo_indptr[1:].to(torch.int64) - 1
                out.append(model.forward(ids, torch.from_numpy(positions), torch.from_numpy(slots), cache, attention,
                                         rows))
        return out
    finally:
        model.c_layers = saved


@pytest.mark.skipif(REASON is not None, reason=f"the C linear kernel does not run here: {REASON}")
@pytest.mark.parametrize("amx", [False, True], ids=["panels", "amx tiles"])
def test_one_c_call_gives_the_loops_logits_bitwise(head64_dir: Path, amx: bool) -> None:
    if amx and not native_linear.plan({"amx_bf16"}, [(32, 32)])[0]:
        pytest.skip("the CPU has no AMX (or the kernel was not granted its tiles)")
    config, weights = load_checkpoint(head64_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=True, native_linear_amx=amx, fused=True)
    assert model.c_layers is not None and model.c_layers.kind == int(amx)
    calls = []
    run = model.c_layers.run
    model.c_layers.run = lambda *args: calls.append(1) or run(*args)  # type: ignore[method-assign]
    looped = two_steps(model, config, "loop")
    assert not calls
    fused = two_steps(model, config, "c_layers")
    assert len(calls) == 2  # both steps took the one-call path
    for a, b in zip(looped, fused):
        assert a.isfinite().all()
        assert torch.equal(a, b)


@pytest.mark.skipif(REASON is not None, reason=f"the C linear kernel does not run here: {REASON}")
def test_one_c_call_prefetching_more_pages_than_its_products_carry(head64_dir: Path) -> None:
    """A 320-token prompt, then its decode of one row: 20 pages of K/V a layer (2,688 cache lines), more
    than that row's q/k/v and down products have K pairs to prefetch them on, so the gate/up product of the
    layer before takes the rest (kernels/native/side_prefetch.h). Prefetches change no result: bitwise the
    loop's logits, and the pages come from a scattered table."""
    config, weights = load_checkpoint(head64_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=512, prepack=True,
                       native_linear=True, fused=True)
    assert model.c_layers is not None
    table = [np.random.default_rng(1).permutation(24)[:21].astype(np.int32)]
    steps = [(np.array([320]), np.array([320])), (np.array([1]), np.array([321]))]
    looped = two_steps(model, config, "loop", tables=table, steps=steps, num_blocks=24)
    fused = two_steps(model, config, "c_layers", tables=table, steps=steps, num_blocks=24)
    for a, b in zip(looped, fused):
        assert a.isfinite().all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("prompts_apart", [False, True], ids=["C prompts", "prompts apart"])
def test_attention_block_call_gives_the_loops_logits_bitwise(head64_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             prompts_apart: bool) -> None:
    """oneDNN's linear layers (as on AMX CPUs): RoPE, the K/V write and attention in one call per layer; with
    `prompts_apart`, the prompt chunks then attend apart after the call (attend_apart_prompts), through the
    same kernel as the loop's attention."""
    import gpu_worker.models.model as model_module

    config, weights = load_checkpoint(head64_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=False, fused=True)
    assert model.c_layers is None
    calls = []
    block = model_module.attention_block
    monkeypatch.setattr(model_module, "attention_block", lambda *args: calls.append(1) or block(*args))
    looped = two_steps(model, config, "loop", prompts_apart)
    assert not calls
    blocks = two_steps(model, config, "block", prompts_apart)
    assert len(calls) == 2 * config.num_hidden_layers  # every layer of both steps
    for a, b in zip(looped, blocks):
        assert a.isfinite().all()
        assert torch.equal(a, b)


@pytest.mark.skipif(REASON is not None or not linear_gguf.supported(linear_gguf.Q4_1, 16, 32),
                    reason="the C linear kernels (bfloat16 and GGUF: AVX512-VNNI) do not run here")
@pytest.mark.parametrize("ggml_type", [linear_gguf.Q4_0, linear_gguf.Q4_1, linear_gguf.Q8_0])
def test_one_c_call_from_gguf_blocks_gives_the_loops_logits_bitwise(head64_dir: Path, ggml_type: int) -> None:
    """The linear weights kept in GGUF blocks (as `quantization` auto keeps a GGUF file's) and computed from them:
    every layer in one C call against the per-layer loop of the same kernels; and close to the same blocks
    dequantized into bfloat16 (the activations' int8 rounding apart)."""
    from gguf.quants import quantize

    config, weights = load_checkpoint(head64_dir)
    blocks = {name: GGUFBlocks(ggml_type, tuple(w.shape), quantize(w.float().numpy(), ggml_type))
              for name, w in weights.items() if name.endswith(BLOCK_WEIGHTS)}
    model = LlamaModel(config, {**weights, **blocks}, torch.device("cpu"), torch.bfloat16, max_positions=256,
                       prepack=True, native_linear=True, fused=True, gguf_blocks=True)
    assert model.c_layers is not None and model.c_layers.kind == GGUF_KIND_BASE + ggml_type
    # A vocabulary of 300 is no multiple of 16: that head is dequantized, and the model still serves.
    assert (type(model.lm_head) is GGUFPackedWeight) == linear_gguf.supported(ggml_type, config.vocab_size,
                                                                             config.hidden_size)
    looped, fused = two_steps(model, config, "loop"), two_steps(model, config, "c_layers")
    dequantized = LlamaModel(config, {**weights, **{n: b.dequantized() for n, b in blocks.items()}},
                             torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True, native_linear=True,
                             fused=True)
    for a, b, c in zip(looped, fused, two_steps(dequantized, config, "c_layers")):
        assert a.isfinite().all() and torch.equal(a, b)
        assert (a - c).abs().max() < 0.05 * c.abs().max()


@pytest.mark.skipif(REASON is not None or not linear_gguf.supported(linear_gguf.Q8_0, 16, 32),
                    reason="the C linear kernels (bfloat16 and GGUF: AVX512-VNNI) do not run here")
def test_int8_weights_run_in_one_c_call_close_to_bfloat16(head64_dir: Path) -> None:
    """`quantization: int8`: every linear weight quantized at load to Q8_0 blocks (the LM head too, where its
    shape fits the kernel), every layer in one C call, bitwise the loop's logits and close to bfloat16's."""
    config, weights = load_checkpoint(head64_dir)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=True, fused=True, int8_weights=True)
    assert model.c_layers is not None and model.c_layers.kind == GGUF_KIND_BASE + linear_gguf.Q8_0
    plain = LlamaModel(config, weights, torch.device("cpu"), torch.bfloat16, max_positions=256, prepack=True,
                       native_linear=True, fused=True)
    for a, b, c in zip(two_steps(model, config, "loop"), two_steps(model, config, "c_layers"),
                       two_steps(plain, config, "c_layers")):
        assert a.isfinite().all() and torch.equal(a, b)
        assert (a - c).abs().max() < 0.05 * c.abs().max()
