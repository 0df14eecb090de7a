"""Data-parallel routing: prefix hit rate per routing policy on 2 replicas of the real stack.

    python benchmarks/data_parallel.py [--groups 8] [--per-group 6] [--prefix 160] [--suffix 16]
                                       [--replicas 2] [--model PATH]

Workload: `groups` groups of requests; the requests of a group share a long prompt prefix
(`prefix` tokens) and differ in a short suffix; all requests arrive in a seeded random
order, in waves of `--wave` concurrent requests. For each policy a fresh stack is started
with `data_parallel_size` replicas.

The hit rate printed is the router's own figure: of the prompts' full KV blocks, the
fraction already routed to the chosen replica (the router's per-replica index of chained
block hashes). It stands for the prefix cache's hit rate; the pool's real prefix-cache
counters (prefix caching is on by default) are printed beside it.
Without --model, a tiny seeded Llama is built in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402
from hetero_infer.testing.stack import free_port, run_stack  # noqa: E402

POLICIES = ("round_robin", "first_prefix_block", "longest_prefix")


def workload(groups: int, per_group: int, prefix: int, suffix: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix)] for _ in range(groups)]
    prompts = [p + [rng.randrange(3, vocab) for _ in range(suffix)] for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def send_all(address: str, prompts: list[list[int]], wave: int, max_tokens: int) -> None:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def one(p: list[int]) -> None:
            await stub.Complete(inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=p), params=params),
                                timeout=300)

        for start in range(0, len(prompts), wave):
            await asyncio.gather(*(one(p) for p in prompts[start:start + wave]))


def run_policy(model: Path, policy: str, replicas: int, prompts: list[list[int]], block_size: int, wave: int,
               max_tokens: int) -> dict:
    addresses = ",".join(f"127.0.0.1:{free_port()}" for _ in range(replicas))
    with run_stack(model, "--block-size", str(block_size), "--max-model-len", "1024", "--log-level", "warning",
                   "--data-parallel-size", str(replicas), "--worker-addresses", addresses,
                   "--routing-policy", policy) as stack:
        started = time.perf_counter()
        asyncio.run(send_all(stack.address, prompts, wave, max_tokens))
        seconds = time.perf_counter() - started
        info = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest())
    pool, service = info.pool, info.service
    return {"policy": policy, "seconds": seconds, "queried": service.routing_prefix_blocks_queried,
            "hit": service.routing_prefix_blocks_hit, "cache_queries": pool.prefix_cache_queries,
            "cache_hits": pool.prefix_cache_hits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--prefix", type=int, default=160)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--wave", type=int, default=4, help="requests sent concurrently")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="HF directory (default: a tiny seeded Llama)")
    args = parser.parse_args()
    if args.model:
        model, vocab = Path(args.model), 30000
    else:
        from hetero_infer.testing.tiny_models import make_tiny_llama

        model, vocab = make_tiny_llama(Path(tempfile.mkdtemp(prefix="dp-bench-")) / "tiny-llama", seed=1), 384
    prompts = workload(args.groups, args.per_group, args.prefix, args.suffix, vocab)
    print(f"workload: {args.groups} groups x {args.per_group} requests, shared prefix {args.prefix} tokens + "
          f"{args.suffix} own, block_size {args.block_size}, {args.replicas} replicas, waves of {args.wave}")
    results = [run_policy(model, p, args.replicas, prompts, args.block_size, args.wave, args.max_tokens) for p in POLICIES]
    print("\nhit rate = prompt full blocks already routed to the chosen replica (the router's index), "
          "not the scheduler's own prefix cache")
    print(f"{'policy':<20} {'blocks':>8} {'hits':>8} {'hit rate':>9} {'seconds':>8} {'prefix-cache hits/queries':>26}")
    for r in results:
        rate = r["hit"] / r["queried"] if r["queried"] else 0.0
        print(f"{r['policy']:<20} {r['queried']:>8} {r['hit']:>8} {rate:>9.1%} {r['seconds']:>8.2f} "
              f"{r['cache_hits']:>12}/{r['cache_queries']:<13}")
    by = {r["policy"]: r["hit"] / max(1, r["queried"]) for r in results}
    ok = by["longest_prefix"] > by["round_robin"]
    print(f"\nlongest_prefix {'beats' if ok else 'does NOT beat'} round_robin: "
          f"{by['longest_prefix']:.1%} vs {by['round_robin']:.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
