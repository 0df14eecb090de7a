"""The stack's own cost per step, with a model whose compute is negligible.

    python benchmarks/step_cost.py [--batches 1,16,64] [--new-tokens 128] [--prompt-len 8] [--json FILE]
                                   [--serve-flags "--omp-wait-policy passive"] [--device cpu|cuda]
                                   [--model tiny|llama-1b] [--client stream|unary|both]

A seeded random 2-layer Llama (hetero_infer/bench/harness.py's make_tiny_llama, hidden 64, vocab 512): its
forward costs well under a millisecond, so what is left of a step is the serving machinery itself (scheduler
bookkeeping, step plans, sampling, protobuf, gRPC hops, Python per step). For each batch size B,
B streams with `--prompt-len`-token prompts each generate `--new-tokens` tokens greedily (EOS
ignored), on the in-process engine and on the three-process stack (`hetero-infer serve`), both
with max_batch_size = the largest B so that every stream decodes in the same step.

Printed per system and B: ms per decode step = (last token's time - first token's time) /
(new_tokens - 1) (all streams start together, so each step after the first gives every stream
one token), and CPU seconds spent per process during the run: the engine's own process; the
stack's gateway, scheduler and worker (psutil on `serve`'s children) and this client.

`--client`: how the B streams call the stack. `stream` (the default): `Generate`, one gRPC message
per token, each timed where it arrives. `unary`: one `Complete` call each (the answer in one message)
asking for `track_generated_token_events`, timed by the scheduler's per-token stamps (wall clock, when
a step's tokens are applied), as the engine's are timed when its step returns them: this leaves out
the gateway's and this client's per-token gRPC messages, which on a small machine share the worker's
cores. `both` runs the stack once with each.

`--device cuda` runs both on the GPU in bfloat16 (the float32 CPU default is the exact mode), with the
config's other defaults (on CUDA: FlashInfer and CUDA graphs where FlashInfer is installed).
`--model llama-1b` swaps the tiny model for a Llama-3.2-1B-shaped one with random weights (16 layers,
hidden 2048, 32 query / 8 KV heads of 64, MLP 8192; a 512-token vocabulary, so ~0.97B parameters):
the issue's case of a GPU whose decode step takes a few milliseconds, where the stack's cost per step
must hide behind the model's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.systems import timed_request  # noqa: E402
from benchmarks.workload import RequestTiming, make_prompts  # noqa: E402
from hetero.v1 import common_pb2, inference_pb2  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from hetero_infer.bench.harness import make_random_llama, make_tiny_llama, run_stack  # noqa: E402

SERVICES = ("gateway", "scheduler", "worker")
# --client: its runs' key in the report (and --json), and its heading in the printout
CLIENTS = {"stream": ("stack", "streaming Generate"), "unary": ("stack_unary", "unary Complete (scheduler token stamps)")}


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def engine_step_cost(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.submit_request(prompts[0], GenerationParams(max_tokens=4, temperature=0.0))
    engine.run()  # warm-up
    cpu_before = time.process_time()
    start = time.perf_counter()
    for p in prompts:
        engine.submit_request(p, params)
    first = last = 0.0
    steps = 0
    while engine.has_pending_work():
        engine.step()
        steps += 1
        if engine.last_step_outputs:
            last = time.perf_counter() - start
            first = first or last
    return {"ms_per_step": (last - first) / (new_tokens - 1) * 1e3, "seconds": time.perf_counter() - start,
            "steps": steps, "cpu_seconds": {"engine": time.process_time() - cpu_before}}


def stack_step_cost(model: Path, batches: list[int], prompts: list[list[int]], new_tokens: int,
                    max_batch: int, serve_flags: list[str], device: str, dtype: str,
                    unary: bool = False) -> dict[int, dict[str, Any]]:
    """`unary`: `Complete` calls timed by the scheduler's token stamps (module docstring); else streams."""
    import grpc

    from hetero.v1 import inference_pb2_grpc

    results: dict[int, dict[str, Any]] = {}
    with run_stack(model, "--log-level", "warning", "--max-batch-size", str(max_batch), "--dtype", dtype,
                   "--device", device, *serve_flags) as stack:
        services = {name: stack.service_process(name) for name in SERVICES}
        client = psutil.Process()
        stack.inference.Complete(inference_pb2.GenerateRequest(
            prompt_token_ids=inference_pb2.TokenIds(ids=prompts[0]), params=common_pb2.SamplingParams(max_tokens=4)))

        async def run(group: list[list[int]]) -> tuple[float, float, float]:
            timings = [RequestTiming() for _ in group]
            async with grpc.aio.insecure_channel(stack.address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                start, wall_start = time.perf_counter(), time.time()
                await asyncio.gather(*(timed_request(stub, ids, new_tokens, unary, timing, start, wall_start,
                                                     timeout=600) for ids, timing in zip(group, timings)))
                return (min(t.token_times[0] for t in timings), max(t.token_times[-1] for t in timings),
                        time.perf_counter() - start)

        for b in batches:
            before = {name: cpu_seconds(p) for name, p in services.items()} | {"client": cpu_seconds(client)}
            first, last, seconds = asyncio.run(run(prompts[:b]))
            after = {name: cpu_seconds(p) for name, p in services.items()} | {"client": cpu_seconds(client)}
            results[b] = {"ms_per_step": (last - first) / (new_tokens - 1) * 1e3, "seconds": seconds,
                          "cpu_seconds": {name: after[name] - before[name] for name in after}}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve-flags", default="", help="more `serve` flags for the stack, e.g. \"--omp-wait-policy passive\"")
    parser.add_argument("--device", default="cpu", help="cpu (float32) or cuda[:N] (bfloat16)")
    parser.add_argument("--model", choices=("tiny", "llama-1b"), default="tiny")
    parser.add_argument("--client", choices=("stream", "unary", "both"), default="stream",
                        help="the stack's clients: streaming Generate, unary Complete, or a run of each")
    args = parser.parse_args()
    configure_logging("warning", "console")
    torch.set_num_threads(os.cpu_count() or 1)
    batches = sorted(int(b) for b in args.batches.split(","))
    max_batch = max(batches)
    # 384: the tiny tokenizer's vocabulary (the gateway checks prompt ids against it), below the model's 512.
    prompts = make_prompts(max_batch, args.prompt_len, args.prompt_len, vocab=384)
    clients = ("stream", "unary") if args.client == "both" else (args.client,)
    report: dict[str, Any] = {"new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "engine": {}}
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model, described = make_tiny_llama(Path(tmp) / "tiny-llama"), "tiny 2-layer Llama (hidden 64, vocab 512)"
        else:
            model = make_random_llama(Path(tmp) / "llama-1b", hidden=2048, intermediate=8192, layers=16, heads=32,
                                      kv_heads=8, scale=0.02, dtype=torch.bfloat16)
            described = "Llama-3.2-1B-shaped, random weights (16 layers, hidden 2048, vocab 512)"
        device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device != "cpu" else "CPU"
        print(f"{described}; {device_name}, {dtype}; B streams x {args.new_tokens} new tokens, "
              f"{args.prompt_len}-token prompts, max_batch_size {max_batch}, {os.cpu_count()} cores"
              + (f"; serve {args.serve_flags}" if args.serve_flags else ""))
        # One engine for every B, built and freed before the stack starts: on a GPU both would hold the card.
        engine = InferenceEngine(Config(model=str(model), max_batch_size=max_batch, dtype=dtype, device=args.device))
        for b in batches:
            report["engine"][b] = engine_step_cost(engine, prompts[:b], args.new_tokens)
        del engine
        gc.collect()
        if args.device != "cpu":
            torch.cuda.empty_cache()
        for client in clients:
            report[CLIENTS[client][0]] = stack_step_cost(model, batches, prompts, args.new_tokens, max_batch,
                                                       args.serve_flags.split(), args.device, dtype,
                                                       unary=client == "unary")
    for client in clients:
        key, heading = CLIENTS[client]
        print(f"\nclients: {heading}")
        print(f"{'B':>4} {'engine ms/step':>15} {'stack ms/step':>14} {'stack/engine':>13}   CPU seconds "
              f"(engine | {' '.join(SERVICES)} client)")
        for b in batches:
            e, s = report["engine"][b], report[key][b]
            cpu = " ".join(f"{s['cpu_seconds'][name]:.2f}" for name in (*SERVICES, "client"))
            print(f"{b:>4} {e['ms_per_step']:>15.2f} {s['ms_per_step']:>14.2f} {s['ms_per_step'] / e['ms_per_step']:>12.1f}x"
                  f"   {e['cpu_seconds']['engine']:.2f} | {cpu}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
