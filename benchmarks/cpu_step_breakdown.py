"""Where the in-process engine's CPU steps spend their time, by kernel, on the default model in its default dtype.

    python benchmarks/cpu_step_breakdown.py [--batch 32] [--min-prompt 120] [--max-prompt 180]
                                            [--prefill-prompts 30] [--new-tokens 48] [--model PATH]

1. Decode: `--batch` seeded prompts decode `--new-tokens` tokens together; per decode step (all sequences in
   it), the wall time split into the decoder layers (the one-call C layers where they run, else the
   per-layer loop), the LM head (`LlamaModel.logits`) and the rest (scheduling, sampling, Python).
2. Prefill: one step of `--prefill-prompts` prompts of 16-256 tokens (up to `max_total_tokens`), run through
   the per-layer loop so that each C kernel's calls can be timed: the linear products, the attention block
   (RoPE, the K/V write and attention), SiLU·mul, RMSNorm, and the rest.
Medians of 3 rounds. Timers wrap the calls from Python, so a kernel's time includes its OpenMP team's start
and end. Run it on an idle box.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_description, cpu_line  # noqa: E402
from benchmarks.workload import make_prompts  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from kernels.native import lib as native_lib  # noqa: E402
from kernels.native import linear as native_linear  # noqa: E402

PREFILL_KERNELS = {"linear_bf16": "linear products", "attention_block_bf16": "attention block",
                   "decode_attention_bf16": "attention", "silu_mul_bf16": "SiLU·mul",
                   "add_rms_norm_bf16": "RMSNorm", "rope_bf16": "RoPE"}


def timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    return call


def decode_breakdown(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """ms per step once every prompt has its first token (decode steps): total, layers, LM head, rest."""
    model = engine.runner.model
    totals: dict[str, float] = {}
    layers_owner, layers_name = (model.c_layers, "run") if model.c_layers is not None else (model, "hidden_states")
    saved = getattr(layers_owner, layers_name), model.logits
    setattr(layers_owner, layers_name, timed(totals, "layers", saved[0]))
    model.logits = timed(totals, "LM head", saved[1])
    try:
        params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ids = {engine.submit_request(p, params) for p in prompts}
        started: set[str] = set()
        while started != ids and engine.has_pending_work():  # the prompts' steps
            engine.step()
            started.update(out.request_id for out in engine.last_step_outputs if out.token_ids)
        totals.clear()
        steps, start = 0, time.perf_counter()
        while engine.has_pending_work():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        setattr(layers_owner, layers_name, saved[0])
        model.logits = saved[1]
    per = {name: t / max(steps, 1) * 1e3 for name, t in totals.items()}
    per["total"] = wall / max(steps, 1) * 1e3
    per["rest"] = per["total"] - per.get("layers", 0.0) - per.get("LM head", 0.0)
    return per


def prefill_breakdown(engine: InferenceEngine, prompts: list[list[int]]) -> dict[str, float]:
    """ms of the first step of `prompts` (a prefill of up to max_total_tokens), through the per-layer loop, by
    C kernel; also the step's prompt tokens."""
    model = engine.runner.model
    library = native_lib.load()
    assert library is not None
    totals: dict[str, float] = {}
    saved_layers, saved_fns = model.c_layers, {name: getattr(library, name) for name in PREFILL_KERNELS}
    model.c_layers = None  # the loop calls each kernel from Python, where it can be timed
    for name, fn in saved_fns.items():
        setattr(library, name, timed(totals, PREFILL_KERNELS[name], fn))
    native_linear._kernels.clear()  # it caches the library's function: take the timed one
    try:
        for p in prompts:
            engine.submit_request(p, GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        while engine.has_pending_work():
            engine.step()
    finally:
        model.c_layers = saved_layers
        for name, fn in saved_fns.items():
            setattr(library, name, fn)
        native_linear._kernels.clear()
    per = {name: t * 1e3 for name, t in totals.items()}
    per["total"] = wall * 1e3
    per["rest"] = per["total"] - sum(t for name, t in per.items() if name != "total")
    return per


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=120)
    parser.add_argument("--max-prompt", type=int, default=180)
    parser.add_argument("--prefill-prompts", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.batch < 1 or args.prefill_prompts < 1 or args.new_tokens < 2 or not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need --batch, --prefill-prompts >= 1, --new-tokens >= 2 and 1 <= --min-prompt <= --max-prompt")
    configure_logging("warning", "console")
    print(cpu_line(cpu_description()))
    engine = InferenceEngine(Config(model=args.model, max_batch_size=max(args.batch, Config().max_batch_size)))
    runner = engine.runner
    vocab = runner.model_config.vocab_size
    print(f"engine: {runner.dtype} on {runner.device}; one-call C layers: {runner.model.c_layers is not None}")
    decode = [decode_breakdown(engine, make_prompts(args.batch, args.min_prompt, args.max_prompt, vocab, seed=r),
                               args.new_tokens) for r in range(3)]
    print(f"\ndecode, {args.batch} sequences of {args.min_prompt}-{args.max_prompt} prompt tokens + up to "
          f"{args.new_tokens}: ms per step (median of 3 rounds)")
    for name in ("total", "layers", "LM head", "rest"):
        print(f"  {name:<18} {statistics.median(d.get(name, 0.0) for d in decode):8.2f}")
    if native_lib.load() is None or runner.dtype.itemsize != 2:
        print(f"\nprefill: not broken down (the C kernels run only in bfloat16; here {runner.dtype})")
        return 0
    prefill = [prefill_breakdown(engine, make_prompts(args.prefill_prompts, 16, 256, vocab, seed=100 + r))
               for r in range(3)]
    names = ["total", *PREFILL_KERNELS.values(), "rest"]
    print(f"\nprefill, one step of {args.prefill_prompts} prompts of 16-256 tokens (at most max_total_tokens "
          f"{engine.config.max_total_tokens}), per-layer loop: ms (median of 3 rounds)")
    for name in names:
        values = [p.get(name, 0.0) for p in prefill]
        if any(values):
            print(f"  {name:<18} {statistics.median(values):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
