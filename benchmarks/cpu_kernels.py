"""The CPU C kernels against what they replace, on a model's own shapes (SmolLM2-135M by default).

    python benchmarks/cpu_kernels.py [--rows 1,32,64,1024] [--batch 32] [--prompt-lens 16,64,136,256,1024]
                                     [--chunk 512,2048] [--repeats 8]

1. Linear layers, bfloat16: one forward's worth of products (every layer's weights distinct, so
   they stream from memory as in a real step) through oneDNN's prepacked weights, the C kernel's
   AVX512-BF16 panels and, on AMX CPUs, its tiles (kernels/native/linear.py), at each row count. Needs
   a CPU with AVX512-BF16.
2. Paged attention, bfloat16: one layer's decode at `--batch` sequences of 16-256 + 32 cached
   tokens (seeded), cycling through one cache per layer so that each call reads cold memory: the
   C kernel's plain loops, its default path (AVX512-BF16 where the CPU has it), and, as a floor for
   reading the same scattered pages, one `index_select` of them.
3. Prompt attention, bfloat16: one layer's causal attention of one fresh prompt of each `--prompt-lens`
   length, torch's SDPA (its flash kernel) against, where they run, the C kernel's per-row path (each row a
   decode up to its position) and its 16-row tiles (AVX512-BF16 CPUs: kernels/native/prompt_row_tiles.c),
   and the AMX tile kernel (kernels/native/prompt_attention.py); and of one `--chunk` (rows, sequence
   tokens) over a cached prefix, the same kernels.
Best of `--repeats`, ms or µs per call. Run it on an idle box: it uses all of torch's threads.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line, linear_shapes  # noqa: E402
from gpu_worker.cpu.packed_linear import linear, pack_weight  # noqa: E402
from gpu_worker.cpu.worker_setup import cpu_flags  # noqa: E402
from gpu_worker.models.checkpoint import load_checkpoint  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from kernels.native import decode_attention as native_decode  # noqa: E402
from kernels.native import lib as native_lib  # noqa: E402
from kernels.native import linear as native_linear  # noqa: E402
from kernels.native import prompt_attention as native_prompt_attention  # noqa: E402
from kernels.torch_attention import _sdpa  # noqa: E402


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_linear(mc, rows: list[int], repeats: int) -> None:
    layer, head = linear_shapes(mc)
    # q, k, v and gate, up as the model fuses them: one product each.
    h, q, kv = layer[0][0], layer[0][1], layer[1][1]
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * layer[4][1]), (layer[6][0], h)]
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen).to(torch.bfloat16) for i, o in shapes]
               for _ in range(mc.num_hidden_layers)]
    head_w = torch.randn(head[1], head[0], generator=gen).to(torch.bfloat16)
    flop_per_row = 2.0 * (mc.num_hidden_layers * sum(i * o for i, o in shapes) + head[0] * head[1])
    packed = {"oneDNN": ([[pack_weight(w) for w in ws] for ws in weights], pack_weight(head_w))}
    why_not = native_linear.unavailable_reason(cpu_flags())
    if why_not is None:
        packed["C kernel"] = ([[pack_weight(w, native=True) for w in ws] for ws in weights],
                              pack_weight(head_w, native=True))
        if native_linear.plan(cpu_flags(), [(o, i) for i, o in shapes] + [(head[1], head[0])])[0]:
            packed["AMX tiles"] = ([[pack_weight(w, native=True, amx=True) for w in ws] for ws in weights],
                                   pack_weight(head_w, native=True, amx=True))
    print(f"\nlinear products of one forward ({len(shapes)} per layer x {mc.num_hidden_layers} + LM head), bfloat16"
          + ("" if why_not is None else f"; C kernel not run: {why_not}"))
    print(f"{'rows':>6} " + " ".join(f"{name + ' ms':>14} {'GFLOP/s':>8}" for name in packed)
          + "   " + ", ".join(f"{name} / oneDNN" for name in list(packed)[1:]) + " (speed)")
    with torch.inference_mode():
        for m in rows:
            inputs = {i: torch.randn(m, i, generator=gen).to(torch.bfloat16) for i, _ in shapes + [head]}
            times = {}
            for name, (layers, lm_head) in packed.items():
                def forward(layers=layers, lm_head=lm_head) -> None:
                    for ws in layers:
                        for (i, _), w in zip(shapes, ws):
                            linear(inputs[i], w)
                    linear(inputs[head[0]], lm_head)
                times[name] = best_of(forward, repeats)
            cells = " ".join(f"{t * 1e3:>14.2f} {m * flop_per_row / t / 1e9:>8.0f}" for t in times.values())
            ratio = "   " + ", ".join(f"{times['oneDNN'] / t:.2f}x" for name, t in times.items() if name != "oneDNN")
            print(f"{m:>6} {cells}{ratio}")


def bench_attention(mc, batch: int, repeats: int) -> None:
    library = native_lib.load()
    if library is None:
        print(f"\nattention: C kernels unavailable: {native_lib.unavailable_reason()}")
        return
    hq, hkv, d, bs = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, 16
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(16 + 32, 256 + 32, (batch,), generator=gen, dtype=torch.int32)
    pages_per_seq = int((lens.max() + bs - 1) // bs)
    num_blocks = batch * pages_per_seq + 64
    pages = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].to(torch.int32).view(batch, -1).contiguous()
    caches = [torch.randn(num_blocks, 2, hkv, bs, d, generator=gen).to(torch.bfloat16)
              for _ in range(mc.num_hidden_layers)]
    cycle = itertools.cycle(caches)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16)
    rows = torch.arange(batch, dtype=torch.int64)
    out = torch.empty_like(q)
    used = torch.cat([pages[b, : (int(lens[b]) + bs - 1) // bs] for b in range(batch)]).long()

    def kernel(fn, *kv_fp8: int) -> Callable[[], object]:  # kv_fp8: the argument the generic loops do not take
        return lambda: fn(q.data_ptr(), q.stride(0), rows.data_ptr(), next(cycle).data_ptr(), pages.data_ptr(),
                          pages.shape[1], lens.data_ptr(), out.data_ptr(), out.stride(0), batch, hq, hkv, d, bs,
                          d ** -0.5, *kv_fp8)

    vector = bool(library.decode_attention_bf16_vectorized(d, bs))
    print(f"\ndecode attention, one layer: batch {batch}, {int(lens.sum())} cached tokens, {hq}/{hkv} heads of {d}, "
          f"block size {bs}, a cold cache per call")
    plain = best_of(kernel(library.decode_attention_bf16_generic), repeats)
    default = best_of(kernel(library.decode_attention_bf16, 0), repeats)
    floor = best_of(lambda: next(cycle).index_select(0, used), repeats)
    print(f"  C plain loops                 {plain * 1e6:8.0f} µs")
    print(f"  C default ({'AVX512-BF16 path' if vector else 'plain loops here'}) {default * 1e6:8.0f} µs   "
          f"{plain / default:.2f}x the plain loops")
    print(f"  index_select of those pages   {floor * 1e6:8.0f} µs   (reading them once, for scale)")


def bench_prompt_attention(mc, lens: list[int], chunk: tuple[int, int], repeats: int) -> None:
    hq, hkv, d, bs = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, 16
    amx_runs = native_prompt_attention.supported(d, hq, hkv)
    c_runs = native_decode.takes_prompts(d, bs)  # the C kernel's AVX512-BF16 path: prompt rows, and its tiles
    if not (amx_runs or c_runs):
        print(f"\nprompt attention: neither the AMX tile kernel nor the C kernel's AVX512-BF16 path runs here "
              f"({hq}/{hkv} heads of {d})")
        return
    gen = torch.Generator().manual_seed(0)

    def case(n: int, kv_len: int):
        pages = torch.randperm(-(-kv_len // bs) + 8, generator=gen)[: -(-kv_len // bs)].to(torch.int32)
        cache = torch.randn(int(pages.max()) + 1, 2, hkv, bs, d, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16)
        return q, cache, pages, torch.empty(n, hq, d, dtype=torch.bfloat16)

    def kernels(q, cache, pages, out, kv_len: int) -> dict[str, Callable[[], object]]:
        """The C kernel's per-row path and its tiles (the rows of one chunk: the last len(q) of kv_len tokens),
        and the AMX tile kernel, where each runs."""
        n = q.shape[0]
        rows = torch.arange(n, dtype=torch.int64)
        row_pages = pages[None, :].expand(n, -1).contiguous()
        row_lens = torch.arange(kv_len - n + 1, kv_len + 1, dtype=torch.int32)
        found: dict[str, Callable[[], object]] = {}
        if c_runs:
            for name, tiles in (("C rows", False), ("C tiles", True)):
                found[name] = lambda tiles=tiles: native_decode.decode_attention(q, rows, cache, row_pages, row_lens,
                                                                                 out, d ** -0.5, tiles=tiles)
        if amx_runs:
            found["AMX tiles"] = lambda: native_prompt_attention.prompt_attention(q, cache, pages, kv_len, out, d ** -0.5)
        return found

    def line(times: dict[str, float], flops: int, base: str) -> str:
        return ", ".join(f"{name} {t * 1e6:7.0f} µs ({flops / t / 1e9:4.0f} GFLOP/s, {times[base] / t:.2f}x)"
                         for name, t in times.items())

    print(f"\nprompt attention, one layer: {hq}/{hkv} heads of {d}, causal, block size {bs} (x: the first's time over "
          f"each)")
    for n in lens:  # a fresh prompt: SDPA on its q/k/v (what runs where neither C path does), then the kernels
        q, cache, pages, out = case(n, n)
        k, v = (torch.randn(1, hkv, n, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        times = {"SDPA": best_of(lambda: _sdpa(q.transpose(0, 1)[None], k, v, None, d ** -0.5, hq // hkv), repeats)}
        times |= {name: best_of(fn, repeats) for name, fn in kernels(q, cache, pages, out, n).items()}
        print(f"  fresh {n:5d} tokens: {line(times, 2 * n * (n + 1) * d * hq, 'SDPA')}")  # q.k and p.v, causal half
    n, kv_len = chunk  # a chunk over a cached prefix
    q, cache, pages, out = case(n, kv_len)
    times = {name: best_of(fn, repeats) for name, fn in kernels(q, cache, pages, out, kv_len).items()}
    print(f"  chunk of {n} over {kv_len - n} cached: {line(times, 2 * n * (2 * kv_len - n + 1) * d * hq, next(iter(times)))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,64,1024")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-lens", default="16,64,136,256,1024")
    parser.add_argument("--chunk", default="512,2048", help="a prompt chunk's rows and its sequence's tokens")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    print(f"{cpu_line()}; torch threads {torch.get_num_threads()}")
    mc, _ = load_checkpoint(resolve_model_path(args.model))
    bench_linear(mc, [int(r) for r in args.rows.split(",")], args.repeats)
    bench_attention(mc, args.batch, args.repeats)
    chunk = tuple(int(x) for x in args.chunk.split(","))
    bench_prompt_attention(mc, [int(n) for n in args.prompt_lens.split(",")], (chunk[0], chunk[1]), args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
