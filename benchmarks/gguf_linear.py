"""A GGUF file's linear layers computed straight from their blocks (kernels/native/linear_gguf.c: Q4_0, Q4_1,
Q8_0 on AVX512-VNNI CPUs) against the same weights dequantized to bfloat16 through the C bfloat16 kernel
(kernels/native/linear.py), one forward's products (every layer and the LM head, each weight once, as a decode
or prefill step streams them) at each row count, the two alternating.

    python benchmarks/gguf_linear.py [--model FILE.gguf] [--rows 1,4,16,32,64,256] [--repeats 6]

The default model is SmolLM2-135M's Q4_1 file (its token embedding, the tied LM head, is Q8_0). Printed per
row count: the best time of each, and the GGUF kernel's time over the bfloat16 one; first, the bytes each
holds. Weights of other types (K-quants, F16) are left out of both. Python calls each product (as the
per-layer loop would), so small products carry a few microseconds of call overhead on both sides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from kernels.native import linear as native_linear  # noqa: E402
from kernels.native import linear_gguf  # noqa: E402


def load_weights(path: Path) -> list[tuple[str, int, int, int, np.ndarray]]:
    """(name, type, out, in, raw blocks) of every 2-D tensor in a type the GGUF kernel takes."""
    from gguf import GGUFReader

    found = []
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2 and linear_gguf.supported(t.tensor_type.value, int(t.shape[1]), int(t.shape[0])):
            found.append((t.name, t.tensor_type.value, int(t.shape[1]), int(t.shape[0]), np.asarray(t.data)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M's Q4_1)")
    parser.add_argument("--rows", default="1,4,16,32,64,256")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    from gguf.quants import dequantize

    print(cpu_line())
    path = resolve_model_path(args.model)
    if path.suffix != ".gguf":
        raise SystemExit(f"{path} is not a .gguf file")
    if not linear_gguf.supported(linear_gguf.Q4_1, 16, 32):
        raise SystemExit("the GGUF linear kernel does not run here (needs AVX512-VNNI and the C kernels built)")
    weights = load_weights(path)
    gguf = [(linear_gguf.pack(blocks, kind, n, k), n) for _, kind, n, k, blocks in weights]
    bf16 = [(native_linear.pack(torch.from_numpy(dequantize(blocks, kind).reshape(n, k)).to(torch.bfloat16)), n)
            for _, kind, n, k, blocks in weights]
    vocab = max(n for _, _, n, _, _ in weights)  # the LM head's logits stay float32 on both sides
    print(f"{path.name}: {len(weights)} weights; held {sum(p.packed.numel() for p, _ in gguf) / 1e6:.1f} MB in blocks, "
          f"{sum(n * k * 2 for _, _, n, k, _ in weights) / 1e6:.1f} MB in bfloat16")
    print(f"{'rows':>6} {'GGUF ms':>10} {'bf16 ms':>10} {'GGUF / bf16':>12}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, _, _, k, _ in weights}
            ins = [inputs[k] for _, _, _, k, _ in weights]

            def run_gguf() -> None:
                for x, (w, n) in zip(ins, gguf):
                    linear_gguf.linear(x, w, f32_out=n == vocab)

            def run_bf16() -> None:
                for x, (w, n) in zip(ins, bf16):
                    native_linear.linear(x, w, out_dtype=torch.float32 if n == vocab else torch.bfloat16)

            best = {"gguf": float("inf"), "bf16": float("inf")}
            for rep in range(args.repeats):
                for name, fn in (("gguf", run_gguf), ("bf16", run_bf16))[:: 1 if rep % 2 == 0 else -1]:
                    start = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"{rows:>6} {best['gguf'] * 1e3:>10.2f} {best['bf16'] * 1e3:>10.2f} {best['gguf'] / best['bf16']:>11.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
