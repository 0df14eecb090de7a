"""Load test under overload, pass or fail: N concurrent streams for a fixed time against the stack on loopback,
run twice, checking that it holds up (`hetero-infer bench` measures latencies against any running gateway;
this starts its own stack, overloads it on purpose and checks for leaks).

    python benchmarks/load_test.py [--streams 200] [--seconds 60] [--runs 2] [--model PATH]
                                   [--max-num-seqs 64] [--max-queued-requests 96]

Each of `streams` clients loops: one streaming Generate (random prompt of 4-64 tokens,
8-48 new tokens, random temperature), read to the end, repeat, until time is up. The queue
bound is set below the number of clients, so RESOURCE_EXHAUSTED answers are deliberate
load shedding (the client backs off 50 ms and tries again); every other failure counts as
a failed request. After each run: the pool must hold zero used blocks, and the gateway's
resident memory is printed; it must not grow from the first run to the second by more
than --rss-slack-mib. Exit status 1 when any check fails. Without --model a tiny seeded
Llama is built in a temporary directory. Latency percentiles: hetero_infer/bench/stats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402
from hetero_infer.bench.stats import percentile  # noqa: E402
from hetero_infer.bench.harness import run_stack, wait_for_idle  # noqa: E402


async def load(address: str, streams: int, seconds: float, vocab: int, seed: int) -> tuple[Counter, int, list[float]]:
    import grpc

    outcomes: Counter = Counter()
    tokens = 0
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def client(i: int) -> None:
            nonlocal tokens
            rng = random.Random(seed * 100_003 + i)
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))]
                params = common_pb2.SamplingParams(max_tokens=rng.randint(8, 48), temperature=rng.choice([0.0, 0.8]),
                                                   ignore_eos=True)
                started = time.monotonic()
                try:
                    got = 0
                    async for msg in stub.Generate(inference_pb2.GenerateRequest(
                            prompt_token_ids=inference_pb2.TokenIds(ids=prompt), params=params), timeout=120):
                        got += len(msg.token_ids)
                    tokens += got
                    outcomes["ok" if got == params.max_tokens else "short"] += 1
                    latencies.append(time.monotonic() - started)
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(0.05)
                    else:
                        print(f"  failed: {exc.code().name}: {exc.details()}", file=sys.stderr)

        await asyncio.gather(*(client(i) for i in range(streams)))
    return outcomes, tokens, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-queued-requests", type=int, default=96)
    parser.add_argument("--rss-slack-mib", type=float, default=8.0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.model:
        model, vocab = Path(args.model), 30000
    else:
        from hetero_infer.bench.harness import make_tiny_llama

        model, vocab = make_tiny_llama(Path(tempfile.mkdtemp(prefix="load-test-")) / "tiny-llama", seed=1), 384
    ok = True
    rss: list[float] = []
    with run_stack(model, "--block-size", "16", "--max-model-len", "512", "--log-level", "warning",
                   "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", str(args.max_queued_requests),
                   "--max-batch-size", str(args.max_num_seqs)) as stack:
        gateway = stack.service_process("gateway")
        print(f"load test: {args.streams} concurrent streams x {args.seconds:g} s, {args.runs} runs; max_num_seqs "
              f"{args.max_num_seqs}, max_queued_requests {args.max_queued_requests}; gateway pid {gateway.pid}, "
              f"RSS at start {gateway.memory_info().rss / 2**20:.1f} MiB")
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            outcomes, tokens, latencies = asyncio.run(load(stack.address, args.streams, args.seconds, vocab, seed=run))
            elapsed = time.monotonic() - started
            pool = wait_for_idle(stack, timeout_s=30.0)
            rss.append(gateway.memory_info().rss / 2**20)
            failed = sum(n for k, n in outcomes.items() if k not in ("ok", "RESOURCE_EXHAUSTED"))
            p50 = percentile(latencies, 50) if latencies else 0.0
            p99 = percentile(latencies, 99) if latencies else 0.0
            print(f"run {run}: {elapsed:.1f} s, completed {outcomes['ok']}, shed (RESOURCE_EXHAUSTED) "
                  f"{outcomes['RESOURCE_EXHAUSTED']}, failed {failed} {dict(outcomes)}, {tokens} tokens "
                  f"({tokens / elapsed:.0f} tok/s), latency p50 {p50:.2f} s p99 {p99:.2f} s; afterwards used_blocks "
                  f"{pool.used_blocks}, running {pool.num_running}, waiting {pool.num_waiting}; gateway RSS {rss[-1]:.1f} MiB")
            ok &= failed == 0 and pool.used_blocks == 0
    if len(rss) >= 2:
        growth = rss[-1] - rss[-2]
        print(f"gateway RSS growth from run {len(rss) - 1} to run {len(rss)}: {growth:+.1f} MiB "
              f"(allowed {args.rss_slack_mib:g} MiB)")
        ok &= growth <= args.rss_slack_mib
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
