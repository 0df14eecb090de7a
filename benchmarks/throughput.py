"""Output tokens/s for the same batch of requests: three-process stack, in-process engine, transformers.

    python benchmarks/throughput.py [--requests 64] [--new-tokens 64] [--min-prompt 16] [--max-prompt 256]
                                    [--hf-batch 16] [--skip-hf] [--model PATH]

Workload: N concurrent requests, prompt lengths uniform in [min, max] tokens (seeded), each
generating exactly `new-tokens` tokens greedily (EOS ignored), on SmolLM2-135M by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, inference_pb2  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where SmolLM2 keeps its special tokens.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_engine(model: str | None, prompts: list[list[int]], new_tokens: int, max_batch_size: int) -> dict:
    engine = InferenceEngine(Config(model=model, max_batch_size=max_batch_size).validate())
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    warm = engine.submit_request(prompts[0][:8], GenerationParams(max_tokens=2, temperature=0.0))
    engine.run()
    del warm
    start = time.perf_counter()
    for p in prompts:
        engine.submit_request(p, params)
    steps = 0
    out_tokens = 0
    while engine.has_pending_work():
        out_tokens += sum(r.generated_tokens for r in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": out_tokens, "steps": steps}


def bench_stack(model: str | None, prompts: list[list[int]], new_tokens: int, max_batch_size: int) -> dict:
    from tests.stack import run_stack

    with run_stack(Path(model) if model else None, "--log-level", "warning",
                   "--max-batch-size", str(max_batch_size)) as stack:
        stub = stack.inference
        stub.Complete(inference_pb2.GenerateRequest(prompt="warm up", params=common_pb2.SamplingParams(max_tokens=2)))
        counts = [0] * len(prompts)
        ttft = [0.0] * len(prompts)

        async def run_all() -> float:
            # One asyncio client for all streams: a thread per stream would steal the cores
            # the worker computes on and measure the client instead of the server.
            import grpc

            from hetero.v1 import inference_pb2_grpc

            async with grpc.aio.insecure_channel(stack.address) as channel:
                aio_stub = inference_pb2_grpc.InferenceStub(channel)
                start = time.perf_counter()

                async def one(i: int) -> None:
                    params = common_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                    req = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=prompts[i]), params=params)
                    async for msg in aio_stub.Generate(req, timeout=900):
                        if not counts[i]:
                            ttft[i] = time.perf_counter() - start
                        counts[i] += len(msg.token_ids)

                await asyncio.gather(*(one(i) for i in range(len(prompts))))
                return time.perf_counter() - start

        elapsed = asyncio.run(run_all())
    ttft.sort()
    return {"seconds": elapsed, "output_tokens": sum(counts), "ttft_p50": ttft[len(ttft) // 2]}


def bench_transformers(model: str | None, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path), torch_dtype=torch.float32, **kwargs).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch):
            chunk = prompts[b:b + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            out_tokens += (out.shape[1] - width) * len(chunk)
    return {"seconds": time.perf_counter() - start, "output_tokens": out_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="sequences per engine step for our paths (config default 32; 64 lets all requests decode together)")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    configure_logging("warning", "console")
    torch.set_num_threads(os.cpu_count() or 1)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, 49152)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"workload: {args.requests} requests, {prompt_tokens} prompt tokens "
          f"({args.min_prompt}-{args.max_prompt} each), {args.new_tokens} new tokens each, {os.cpu_count()} cores")
    results = {"stack (3 processes, gRPC)": bench_stack(args.model, prompts, args.new_tokens, args.max_batch_size),
               "in-process engine": bench_engine(args.model, prompts, args.new_tokens, args.max_batch_size)}
    if not args.skip_hf:
        results[f"transformers generate (batches of {args.hf_batch})"] = bench_transformers(
            args.model, prompts, args.new_tokens, args.hf_batch)
    print(f"\n{'path':<40} {'seconds':>9} {'out tokens':>11} {'out tok/s':>10}")
    for name, r in results.items():
        print(f"{name:<40} {r['seconds']:>9.2f} {r['output_tokens']:>11} {r['output_tokens'] / r['seconds']:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
