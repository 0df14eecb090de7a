"""Prompt logprobs and the prefix cache: what skipping the cache costs, measured on the real stack.

    python benchmarks/prompt_logprobs_cache.py [--model PATH] [--prompt-tokens 512] [--repeats 3] [--dtype auto]

A request that asks for prompt logprobs takes no prefix-cache hit (cached positions have no
logits). The alternative, recomputing the cached positions, runs the same forward over the same
tokens, so it costs what skipping costs. This prints the time to first token (gRPC Generate,
first message) of a `--prompt-tokens` prompt, median of `--repeats`:
- plain / echo (prompt_logprobs=1) on a cold cache (a fresh cache_salt each time);
- plain / echo on a warm cache (the same prompt and salt sent just before).
Echo warm should equal echo cold (no hit taken); plain warm shows what a hit would have saved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, inference_pb2  # noqa: E402
from hetero_infer.testing.stack import Stack, run_stack  # noqa: E402


def ttft(stack: Stack, ids: list[int], salt: str, echo: bool) -> tuple[float, int]:
    params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    if echo:
        params.prompt_logprobs = 1
    request = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), params=params,
                                            cache_salt=salt)
    started = time.perf_counter()
    messages = stack.inference.Generate(request, timeout=600)
    first = next(messages)
    elapsed = time.perf_counter() - started
    cached = 0
    for message in [first, *messages]:
        cached = max(cached, message.usage.cached_prompt_tokens)
    return elapsed, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the served default (SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
    flags = ["--dtype", args.dtype, "--log-level", "warning", "--max-model-len", str(args.prompt_tokens + 64)]
    with run_stack(Path(args.model) if args.model else None, *flags) as stack:
        ttft(stack, ids[:32], "warm-up", echo=True)
        rows: dict[str, list[float]] = {"plain cold": [], "echo cold": [], "plain warm": [], "echo warm": []}
        hits: dict[str, int] = {}
        for _ in range(args.repeats):
            for echo in (False, True):
                name = "echo" if echo else "plain"
                seconds, hit = ttft(stack, ids, uuid.uuid4().hex, echo)  # a fresh salt: nothing cached
                rows[f"{name} cold"].append(seconds)
                hits[f"{name} cold"] = hit
                salt = uuid.uuid4().hex
                ttft(stack, ids, salt, echo=False)  # warms the cache for this salt
                seconds, hit = ttft(stack, ids, salt, echo)
                rows[f"{name} warm"].append(seconds)
                hits[f"{name} warm"] = hit
    print(f"prompt of {args.prompt_tokens} tokens, dtype {args.dtype}, median of {args.repeats}")
    print(f"{'request':<12} {'TTFT ms':>9} {'cached prompt tokens':>22}")
    for name, values in rows.items():
        print(f"{name:<12} {statistics.median(values) * 1000:9.1f} {hits[name]:22d}")


if __name__ == "__main__":
    main()
