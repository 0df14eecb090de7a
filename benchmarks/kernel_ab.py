"""Two builds of the CPU C kernels in one process: this checkout's and another git revision's, on the
in-process engine's steps, interleaved, so that a virtual machine's drift between runs (±15% on the
development box) does not decide an A/B of a few percent.

    python benchmarks/kernel_ab.py [--base HEAD~1] [--reps 8] [--batch 32] [--min-prompt 120]
                                   [--max-prompt 180] [--new-tokens 48] [--model PATH] [--products ROWS]

The base revision's `kernels/native/` (`git archive`) is compiled with the same flags as this checkout's
(kernels/native/lib.py). The engine (the config's defaults: bfloat16 where `dtype: auto` picks it) then
runs `--reps` rounds; in each, both builds in turn (the order alternating) take `--batch` seeded prompts
of `--min-prompt`-`--max-prompt` random tokens to `--new-tokens` greedy tokens each, with every decoder
layer running through that build's `llama_layers_bf16` (the one-call layers, gpu_worker/cpu/c_layers.py:
the linear products, attention and element-wise kernels of every layer; the LM head and sampling stay
this checkout's). Printed: each round's time of the prompts' steps (prefill) and median decode-step time per
build, and this checkout's times over the base's per round and their medians. Needs a CPU where the one-call layers run (AVX512-BF16, the
C kernels built), and the same `llama_layers_bf16` signature in both revisions.

`--products 16,32,...` compares the two builds' `linear_bf16` instead: one forward's products of the model's
shapes (every layer's weights distinct, as in a step, packed by this checkout's `linear_bf16_pack`, which
must be the base's layout too) at each row count, `--reps` rounds per count.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_description, cpu_line  # noqa: E402
from benchmarks.workload import make_prompts  # noqa: E402
from gpu_worker.cpu.c_layers import CLayers  # noqa: E402
from gpu_worker.models.checkpoint import load_checkpoint  # noqa: E402
from gpu_worker.models.model_shapes import linear_shapes  # noqa: E402
from gpu_worker.parallel.tensor_parallel import TensorParallel  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.device_defaults import SEED_MAX_BATCH_SIZE  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from kernels.native import lib as native_lib  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAYERS = "llama_layers_bf16"


def build_revision(revision: str, workdir: Path) -> ctypes.CDLL:
    """`revision`'s kernels/native/, compiled into workdir; its llama_layers_bf16 bound with this checkout's signature."""
    archive = subprocess.run(["git", "archive", revision, "kernels/native"], cwd=REPO, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(workdir, filter="data")
    sources = sorted((workdir / "kernels" / "native").glob("*.c"))
    compiler = native_lib.find_compiler()
    if compiler is None:
        raise SystemExit("no C compiler (cc, gcc or $CC) on PATH")
    target = workdir / "base_kernels.so"
    native_lib.build_library(compiler, sources, target)
    library = ctypes.CDLL(str(target))
    bind_base(library, LAYERS)
    return library


def bind_base(library: ctypes.CDLL, name: str) -> Any:
    fn = getattr(library, name)
    fn.restype, fn.argtypes = native_lib.SIGNATURES[name]
    return fn


def compare_products(base: ctypes.CDLL, current: ctypes.CDLL, model: str | None, rows: list[int], reps: int) -> None:
    """One forward's linear products through each build's linear_bf16, interleaved; prints the time ratios."""
    mc, _ = load_checkpoint(resolve_model_path(model))
    del _
    *layer, head = linear_shapes(mc, TensorParallel())  # [out, in]: q/k/v, o, gate/up, down; the LM head
    gen = torch.Generator().manual_seed(0)
    weights = []
    for o, i in layer * mc.num_hidden_layers + [head]:
        weight = torch.randn(o, i, generator=gen).to(torch.bfloat16)  # held until packed
        packed = torch.empty(current.linear_bf16_packed_elements(o, i), dtype=torch.int16)
        current.linear_bf16_pack(weight.data_ptr(), o, i, packed.data_ptr())
        weights.append((i, o, packed))
    fns = {"base": bind_base(base, "linear_bf16"), "this": current.linear_bf16}
    print(f"one forward's linear products ({len(weights)}), median ms of {reps} rounds")
    for m in rows:
        inputs = {i: torch.randn(m, i, generator=gen).to(torch.bfloat16) for i, _, _ in weights}
        out = torch.empty(m, max(o for _, o, _ in weights), dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for rep in range(reps):
            for name in (("base", "this") if rep % 2 == 0 else ("this", "base")):
                start = time.perf_counter()
                for i, o, packed in weights:
                    fns[name](inputs[i].data_ptr(), i, packed.data_ptr(), None, out.data_ptr(), o, m, o, i)
                times[name].append(time.perf_counter() - start)
        ratios = [t / b for t, b in zip(times["this"], times["base"])]
        print(f"  {m:5d} rows: base {statistics.median(times['base']) * 1e3:8.2f}, this "
              f"{statistics.median(times['this']) * 1e3:8.2f}; this / base median {statistics.median(ratios):.3f}x, "
              f"faster in {sum(r < 1 for r in ratios)} of {reps}")


def step_times_ms(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(the prompts' steps' total time: every step until the first that decodes every sequence, the median time
    of the steps in which every sequence decodes)."""
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.submit_request(p, params)
    times: list[tuple[int, float]] = []
    while engine.has_pending_work():
        start = time.perf_counter()
        engine.step()
        times.append((len(engine.last_step_outputs), time.perf_counter() - start))
    first_full = len(times) - new_tokens + 1
    full = [t for n, t in times[first_full:] if n == len(prompts)]
    return sum(t for _, t in times[:first_full]) * 1e3, statistics.median(full) * 1e3


def ratio_line(what: str, times: dict[str, list[float]]) -> str:
    ratios = [t / b for t, b in zip(times["this"], times["base"])]
    return (f"this / base {what}: median {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-"
            f"{max(ratios):.3f}); faster in {sum(r < 1 for r in ratios)} of {len(ratios)} rounds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare this checkout's kernels with")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=120)
    parser.add_argument("--max-prompt", type=int, default=180)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--model", default=None)
    parser.add_argument("--products", default=None, help="row counts: compare the builds' linear products instead")
    args = parser.parse_args()
    configure_logging("warning", "console")
    if args.reps < 1 or args.batch < 1 or args.new_tokens < 4 or not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need --reps >= 1, --batch >= 1, --new-tokens >= 4 and 1 <= --min-prompt <= --max-prompt")
    print(cpu_line(cpu_description()))
    current = native_lib.load()
    if current is None:
        raise SystemExit(f"the C kernels are unavailable: {native_lib.unavailable_reason()}")
    if args.products:
        if not current.linear_bf16_supported():
            raise SystemExit("the C linear kernel does not run here (no AVX512-BF16)")
        with tempfile.TemporaryDirectory() as tmp:
            compare_products(build_revision(args.base, Path(tmp)), current, args.model,
                             [int(r) for r in args.products.split(",")], args.reps)
        return 0
    # No prefix cache: both builds compute every prompt of a round (the second would find the first's blocks).
    engine = InferenceEngine(Config(model=args.model, max_batch_size=max(args.batch, SEED_MAX_BATCH_SIZE),
                                    enable_prefix_caching=False))
    layers: CLayers | None = engine.runner.model.c_layers
    if layers is None:
        raise SystemExit("the engine does not run its layers in one C call here (needs AVX512-BF16 and dtype "
                         "bfloat16): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": getattr(build_revision(args.base, Path(tmp)), LAYERS), "this": getattr(current, LAYERS)}
        vocab = engine.runner.model_config.vocab_size
        print(f"{args.batch} sequences, {args.min_prompt}-{args.max_prompt}-token prompts + {args.new_tokens} "
              f"tokens; base = {args.base}, this = the checkout; ms for the prompts' steps, median ms per decode step")
        prompt_ms: dict[str, list[float]] = {name: [] for name in builds}
        decode_ms: dict[str, list[float]] = {name: [] for name in builds}
        for rep in range(args.reps):
            prompts = make_prompts(args.batch, args.min_prompt, args.max_prompt, vocab=vocab, seed=rep)
            for name in (("base", "this") if rep % 2 == 0 else ("this", "base")):
                layers._fn = builds[name]
                prefill, decode = step_times_ms(engine, prompts, args.new_tokens)
                prompt_ms[name].append(prefill), decode_ms[name].append(decode)
            print(f"  round {rep + 1}: prompts base {prompt_ms['base'][-1]:.1f}, this {prompt_ms['this'][-1]:.1f}; "
                  f"decode step base {decode_ms['base'][-1]:.2f}, this {decode_ms['this'][-1]:.2f}")
        print(ratio_line("prompt steps", prompt_ms))
        print(ratio_line("decode step", decode_ms))
        layers._fn = builds["this"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
