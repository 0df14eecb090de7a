"""GPU benchmark: bandwidth, decode tokens/s with and without CUDA graphs, TTFT, roofline, attention kernels.

    python benchmarks/gpu_bench.py [--batch-sizes 1,16,64,256] [--context 1000] [--steps 30] [--breakdown]
                                   [--shape 1b|8b] [--kv-cache-dtype auto|fp8] [--quantization none|fp8]
                                   [--compare-decode-cores] [--unfused] [--json out.json]

Builds (element-wise passes through FlashInfer's fused kernels, as the worker by default; `--unfused`: torch's ops) a Llama-shaped model of about 1.2B parameters (Llama-3.2-1B's shape: 16 layers, hidden
2048, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128256, tied embeddings; `--shape 8b`: Llama-3-8B's,
32 layers, hidden 4096, heads of 128, MLP 14336) with random bf16 weights on the device (nothing is downloaded), and measures, on the worker's own code
(`LlamaModel`, the FlashInfer backend, `DecodeGraphs`):

- device-to-device copy bandwidth (bytes read + written per second);
- decode tokens/s at each batch size, every sequence with `--context` cached tokens, eager and
  with CUDA graphs; each step includes plan(), the forward pass and a greedy argmax read back to
  the host, as the worker does;
- the fraction of the bandwidth roofline: (weight bytes + KV bytes read) per step / step time /
  measured bandwidth;
- time to first token of a 2,000-token prompt (one prefill step + argmax);
- FlashInfer decode attention (one layer) against the torch reference at batch 64, same context;
- with `--breakdown`, where a graph decode step's time goes, per batch size (medians of `--steps`): the
  whole step; `DecodeGraphs.run()` on the host, from an idle GPU to its return (the replay is only
  launched by then: padding the page table, FlashInfer's `plan()`, the input copies); `plan()` alone (the
  page table already padded); the replay alone, between CUDA events; the read-back alone (argmax and
  `.tolist()` of logits already computed). The step minus the replay is what the GPU waits for the host.

`--kv-cache-dtype fp8`: the cache in float8 e4m3 (config `kv_cache_dtype: fp8`), read by FlashInfer's fp8 KV
kernels; `--quantization fp8`: the layers' linear weights in float8 e4m3 (config `quantization: fp8`,
torch._scaled_mm). Compare their decode tokens/s with a run of the defaults (bf16) at the same batch and context.

On a machine without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_steps import (  # noqa: E402
    BLOCK_SIZE,
    DTYPE,
    cuda_time,
    decode_cores_us,
    decode_table,
    graph_step_breakdown,
    mixed_step_ms,
    print_breakdown,
)
from gpu_worker.model_config import ModelConfig  # noqa: E402
from kernels.cache_ops import allocate_kv_cache, convert_layout  # noqa: E402
from kernels.flashinfer_backend import flashinfer_unavailable_reason  # noqa: E402
from kernels.fp8_linear import Fp8Weight  # noqa: E402
from kernels.page_table import PageTable  # noqa: E402
from kernels.torch_attention import TorchPagedAttention  # noqa: E402

LLAMA_1B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=8192,
                       tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=())
# Llama-3-8B's shape (issue 39's fp8 figures): 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336.
LLAMA_8B = replace(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                   tie_word_embeddings=False)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
# Issue 37's targets (batch -> fraction of the copy-bandwidth roofline, CUDA graphs on): SGLang's published batch-1
# figure for the 1B shape is about 53%.
ROOFLINE_TARGETS = {"1b": {1: 0.55, 64: 0.65}, "8b": {1: 0.80, 64: 0.75}}


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=DTYPE, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * nbytes / cuda_time(lambda: dst.copy_(src), 20)


def random_weights(c: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=DTYPE, device=device).normal_(std=0.02)

    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
         "model.norm.weight": torch.ones(c.hidden_size, dtype=DTYPE, device=device)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rand(q, c.hidden_size), p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
                  p + "self_attn.v_proj.weight": rand(kv, c.hidden_size), p + "self_attn.o_proj.weight": rand(c.hidden_size, q),
                  p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
                  p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
                  p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
                  p + "input_layernorm.weight": torch.ones(c.hidden_size, dtype=DTYPE, device=device),
                  p + "post_attention_layernorm.weight": torch.ones(c.hidden_size, dtype=DTYPE, device=device)})
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    return w


def model_bytes(model) -> int:
    """Bytes of the weights a decode step reads (fp8 weights: their values and scales)."""
    tensors = [model.embed, model.final_norm] + [t for layer in model.layers for t in layer.values() if t is not None]
    if model.lm_head is not model.embed:
        tensors.append(model.lm_head)
    parts = [p for t in tensors for p in ((t.weight, t.scale) if isinstance(t, Fp8Weight) else (t,))]
    return sum(p.numel() * p.element_size() for p in parts)


def gpu_unavailable(tool: str) -> int | None:
    """None where a CUDA device and FlashInfer are there; else, having said why, the exit code: 0 on a
    machine without a GPU (nothing to measure), 1 where FlashInfer is missing on one."""
    if not torch.cuda.is_available():
        print(f"{tool}: no CUDA device is visible; it runs only on a GPU machine (see the README's GPU section: "
              "scripts/gpu_carry.sh, then scripts/gpu_run.sh there).")
        return 0
    reason = flashinfer_unavailable_reason(torch.device("cuda"), LLAMA_1B.head_dim, DTYPE)
    if reason is not None:
        print(f"{tool}: FlashInfer cannot run here ({reason}); install it as scripts/gpu_run.sh does.")
        return 1
    return None


def graph_decode_attention(cfg: ModelConfig, pages_per_seq: int, device: torch.device,
                           workspace: torch.Tensor, kv_dtype: torch.dtype = DTYPE) -> Callable[[int], object]:
    """`DecodeGraphs`' make_attention: a FlashInfer graph decode for `bs` sequences of up to `pages_per_seq`
    pages each, sharing the eager attention's workspace."""
    from kernels.flashinfer_backend import FlashInferGraphDecode

    def make(bs: int) -> FlashInferGraphDecode:
        indices = torch.zeros(bs * pages_per_seq, dtype=torch.int32, device=device)
        return FlashInferGraphDecode(bs, indices, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                     device, DTYPE, workspace, kv_dtype)

    return make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1000, help="cached tokens per sequence in decode steps")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens for time to first token")
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps per configuration")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the parts of a graph decode step at each batch size (host, plan, replay, read-back)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the cache's element: the model's bf16, or float8 e4m3")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                        help="the model's shape: Llama-3.2-1B's (the default) or Llama-3-8B's")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="the layers' linear weights: bf16, or float8 e4m3 with per-channel scales")
    parser.add_argument("--compare-decode-cores", action="store_true",
                        help="also time FlashInfer's decode attention through CUDA cores and through tensor cores for "
                             "this shape's GQA group (the worker takes tensor cores above a group of 4); the "
                             "tensor-core path JIT-compiles FA2's module for the head size on first use")
    parser.add_argument("--unfused", action="store_true",
                        help="torch's separate element-wise ops instead of FlashInfer's fused kernels (config "
                             "use_flashinfer_fused_rope false), to compare")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE
    if (code := gpu_unavailable("gpu_bench")) is not None:
        return code
    device = torch.device("cuda")
    import flashinfer

    from gpu_worker.cuda.cuda_graphs import DecodeGraphs
    from gpu_worker.models.model import LlamaModel
    from kernels.flashinfer_backend import FlashInferPagedAttention

    torch.manual_seed(0)
    cfg = SHAPES[args.shape]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                     "flashinfer": flashinfer.__version__, "context": args.context,
                     "kv_cache_dtype": str(kv_dtype).removeprefix("torch."), "quantization": args.quantization}
    print(f"device: {results['device']}  torch {torch.__version__}  flashinfer {flashinfer.__version__}")

    bandwidth = copy_bandwidth(device)
    results["copy_bandwidth_gbs"] = bandwidth / 1e9
    print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    with torch.inference_mode():
        started = time.perf_counter()
        max_positions = max(args.context + args.steps + 8, args.prompt + 8)
        model = LlamaModel(cfg, random_weights(cfg, device), device, DTYPE, max_positions,
                           fp8_weights=args.quantization == "fp8", fused=not args.unfused)
        results["elementwise"] = model.elementwise
        torch.cuda.empty_cache()
        weight_bytes = model_bytes(model)
        results["weight_bytes"] = weight_bytes
        print(f"model: {weight_bytes / 2**30:.2f} GiB of weights ({args.quantization} linear layers, "
              f"{model.elementwise} element-wise ops) "
              f"(built in {time.perf_counter() - started:.1f} s)")

        pages_per_seq = -(-(args.context + 1) // BLOCK_SIZE)
        max_batch = max(batch_sizes + [64])
        num_blocks = max(max_batch * pages_per_seq, 63 * pages_per_seq + 32, -(-args.prompt // BLOCK_SIZE)) + 1
        kv = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                               kv_dtype, device)
        for layer_cache in kv:  # random values, a layer at a time (fp8 has no normal_())
            layer_cache.copy_(torch.empty(layer_cache.shape, dtype=DTYPE, device=device).normal_())
        pad_block = num_blocks - 1
        kv_bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kv.element_size()
        attention = FlashInferPagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device,
                                             DTYPE, kv_dtype=kv_dtype)
        started = time.perf_counter()
        jit_table = decode_table(1, 15, 0)
        attention.plan(jit_table)
        jit_pos, jit_slots = jit_table.token_positions()
        model.forward(torch.zeros(1, dtype=torch.int64, device=device), torch.from_numpy(jit_pos).to(device),
                      torch.from_numpy(jit_slots).to(device), kv, attention, torch.zeros(1, dtype=torch.int64, device=device))
        torch.cuda.synchronize()
        print(f"first FlashInfer decode step (JIT compile or cache load): {time.perf_counter() - started:.1f} s")

        rows: list[dict] = []
        breakdown: list[dict] = []
        print(f"\ndecode, {args.context} cached tokens per sequence (each step: plan + forward + argmax to host)")
        print(f"{'batch':>6} {'graphs':>7} {'step ms':>9} {'tok/s':>10} {'GB/step':>8} {'roofline':>9}")
        for b in batch_sizes:
            table = decode_table(b, args.context, 0)
            positions, slots = table.token_positions()
            ids = np.random.default_rng(b).integers(0, cfg.vocab_size, b)
            ids_dev, pos_dev = torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device)
            slots_dev, rows_dev = torch.from_numpy(slots).to(device), torch.arange(b, device=device)
            graphs = DecodeGraphs(model, kv, [b], pad_block, BLOCK_SIZE,
                                  graph_decode_attention(cfg, pages_per_seq, device, attention.workspace, kv_dtype))
            graphs.capture()

            def eager_step() -> list[int]:
                attention.plan(table)
                return model.forward(ids_dev, pos_dev, slots_dev, kv, attention, rows_dev).argmax(-1).tolist()

            def graph_step() -> list[int]:  # as the worker's plain greedy steps: the graph's own argmax
                graphs.run(table, ids, positions)
                return graphs.greedy_tokens().tolist()

            step_bytes = weight_bytes + b * (args.context + 1) * kv_bytes_per_token
            for use_graphs, step in ((False, eager_step), (True, graph_step)):
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(args.steps):
                    step()
                seconds = (time.perf_counter() - started) / args.steps
                row = {"batch": b, "graphs": use_graphs, "step_ms": seconds * 1e3, "tokens_per_s": b / seconds,
                       "bytes_per_step": step_bytes, "roofline_fraction": step_bytes / seconds / bandwidth}
                rows.append(row)
                print(f"{b:>6} {'on' if use_graphs else 'off':>7} {row['step_ms']:>9.2f} {row['tokens_per_s']:>10.0f} "
                      f"{step_bytes / 1e9:>8.2f} {row['roofline_fraction']:>8.0%}")
            print(f"{'':>6} graph capture {graphs.capture_seconds:.2f} s")
            if args.breakdown:
                breakdown.append({"batch": b, **graph_step_breakdown(graphs, table, ids, positions, args.steps)})
        results["decode"] = rows
        if args.breakdown:
            print_breakdown(breakdown, args.steps)
            results["graph_step_breakdown"] = breakdown

        results["mixed_step_ms"] = mixed_step_ms(model, attention, kv, cfg, args.context, args.steps)
        print(f"\nmixed step, one 512-token prompt chunk + 63 decodes of {args.context} cached tokens, eager: "
              f"{results['mixed_step_ms']:.2f} ms (no mixed-step graphs yet)")

        # Time to first token: one prefill step of the whole prompt, then the argmax on the host.
        prompt_table = PageTable.build([np.arange(-(-args.prompt // BLOCK_SIZE), dtype=np.int32)],
                                       np.array([args.prompt]), np.array([args.prompt]), BLOCK_SIZE)
        p_pos, p_slots = prompt_table.token_positions()
        p_ids = torch.randint(0, cfg.vocab_size, (args.prompt,), device=device)
        last = torch.tensor([args.prompt - 1], device=device)

        def first_token() -> int:
            attention.plan(prompt_table)
            logits = model.forward(p_ids, torch.from_numpy(p_pos).to(device), torch.from_numpy(p_slots).to(device),
                                   kv, attention, last)
            return int(logits.argmax(-1).item())

        first_token()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            first_token()
            times.append(time.perf_counter() - started)
        results["ttft_ms"] = statistics.median(times) * 1e3
        print(f"\ntime to first token, {args.prompt}-token prompt: {results['ttft_ms']:.1f} ms (median of 5)")

        # Attention kernels alone: one layer, batch 64 decode, same context.
        b = 64
        table = decode_table(b, args.context, 0)
        q = torch.randn(b, cfg.num_attention_heads, cfg.head_dim, dtype=DTYPE, device=device)
        layer = kv[0]
        attention.plan(table)
        for _ in range(3):
            attention.run(q, layer)
        fi_seconds = cuda_time(lambda: attention.run(q, layer), 100)
        reference = TorchPagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device)
        reference.plan(table)
        ref_layer = convert_layout(layer, attention.kv_layout, reference.kv_layout)
        for _ in range(2):
            reference.run(q, ref_layer)
        torch_seconds = cuda_time(lambda: reference.run(q, ref_layer), 10)
        results["attention_us"] = {"flashinfer": fi_seconds * 1e6, "torch": torch_seconds * 1e6}
        if args.compare_decode_cores:
            results["decode_cores_us"] = decode_cores_us(attention.workspace, table, q, layer, cfg, kv_dtype)
            print(f"decode attention by CUDA cores / tensor cores (group {cfg.num_attention_heads // cfg.num_key_value_heads}"
                  f", batch {b}): {results['decode_cores_us']['cuda_cores']:.1f} / "
                  f"{results['decode_cores_us']['tensor_cores']:.1f} us")
        print(f"decode attention, batch {b} x {args.context + 1} tokens, one layer: FlashInfer {fi_seconds * 1e6:.1f} us, "
              f"torch reference {torch_seconds * 1e6:.1f} us ({torch_seconds / fi_seconds:.1f}x)")

    by = {(r["batch"], r["graphs"]): r for r in rows}
    checks = []
    for batch, share in ROOFLINE_TARGETS[args.shape].items():  # issue 37's targets, with graphs
        if (batch, True) in by:
            checks.append((f"decode batch {batch} with graphs >= {share:.0%} of the roofline",
                           by[(batch, True)]["roofline_fraction"] >= share))
    checks.append(("FlashInfer attention >= 3x the torch reference at batch 64", torch_seconds / fi_seconds >= 3))
    if (1, True) in by:
        checks.append(("graphs >= 1.3x eager at batch 1",
                       by[(1, False)]["step_ms"] / by[(1, True)]["step_ms"] >= 1.3))
    results["targets"] = {name: ok for name, ok in checks}
    print("\ntargets:")
    for name, ok in checks:
        print(f"  [{'met' if ok else 'MISSED'}] {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
