"""`hetero-infer bench`: arguments, the arrival process, the run, the outputs."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the clients (httpx, grpc) and numpy load only when bench runs, not with every CLI command
    from hetero_infer.bench.clients import RequestRecord
    from hetero_infer.bench.dataset import BenchRequest


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--target", default=None,
                   help="gRPC host:port (default 127.0.0.1:50051) or HTTP base URL (default http://127.0.0.1:8000)")
    p.add_argument("--model", default="", help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("HETERO_API_KEY"), help="bearer key (env HETERO_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="CA file when the gateway serves TLS")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--dataset", default=None, help="JSONL file of {\"prompt\": ..., \"max_tokens\": ...} (else synthetic)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request (EOS ignored)")
    p.add_argument("--length-spread", type=float, default=0.5, help="relative spread of both lengths (0 = fixed)")
    p.add_argument("--length-distribution", choices=["uniform", "normal", "fixed"], default="uniform")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results", help="where results.json and results.png go")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


async def _run(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    from tqdm import tqdm

    from hetero_infer.bench.clients import GrpcClient, HttpClient

    if args.protocol == "grpc":
        client: GrpcClient | HttpClient = GrpcClient(args.target, args.api_key, args.model, args.tls_ca)
    else:
        client = HttpClient(args.target, args.api_key, args.model, args.tls_ca)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)
    bar = tqdm(total=len(requests), unit="req", disable=args.no_progress, file=sys.stderr)
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        if limit is None:
            record = await client.run(req, t0)
        else:
            async with limit:
                record = await client.run(req, t0)
        bar.update(1)
        return record

    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson process: exponential gaps
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    bar.close()
    await client.close()
    return records, duration


def run_bench(args: argparse.Namespace) -> int:
    from hetero_infer.bench.dataset import from_jsonl, synthetic
    from hetero_infer.bench.report import plot, summarize, table, write_json

    args.target = args.target or ("127.0.0.1:50051" if args.protocol == "grpc" else "http://127.0.0.1:8000")
    if args.dataset:
        requests = from_jsonl(args.dataset, args.num_prompts, args.output_len)
    else:
        requests = synthetic(args.num_prompts, args.input_len, args.output_len, args.length_spread,
                             args.length_distribution, args.seed)
    records, duration = asyncio.run(_run(args, requests))
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "command")}
    settings["request_rate"] = "inf" if args.request_rate == float("inf") else args.request_rate
    result = summarize(records, duration, settings)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "results.json")
    plot(records, result, out / "results.png")
    print(table(result))
    print(f"wrote {out / 'results.json'} and {out / 'results.png'}")
    return 0 if result["requests"]["completed"] else 1
