"""The scheduler's own bookkeeping, without a model: µs per step and per scheduled sequence-step.

    python benchmarks/scheduler_bench.py [--requests 256] [--pool ample|tight|both]
        [--arrivals all|trickle|both] [--nano-vllm PATH]

A seeded synthetic trace: `--requests` prompts of 32-1,024 tokens, a quarter of them starting
with one of 8 shared 512-token prefixes, 16-256 output tokens each (never EOS: every request
ends by length). A fake worker answers each plan with one token per sampled sequence; only
`Scheduler.schedule()` + `Scheduler.process_result()` are timed (the fake worker, request
submission and trace generation are not). Defaults: block size 256, 512 sequences and 16,384
tokens per step, prefix caching (lru), recompute preemption, a prompt chunk capped only by the
step's token budget, memory threshold 1.0.

Pools: `ample` holds every request's prompt and output at once (sum of their blocks: no
preemption), `tight` a quarter of that (preemptions). Arrivals: `all` submits the whole trace
before the first step, `trickle` submits `--rate` requests per step (the steps between arrivals
with nothing to do are skipped, not timed).

Reported per configuration: steps, scheduled sequence-steps (the sum of every step's batch),
µs/step, µs per sequence-step, and µs per sequence-step by batch size (flat = cost linear in
the batch). Each configuration runs `--repeat` times; the fastest run is reported.

`--nano-vllm PATH`: a checkout of GeeeekExplorer/nano-vllm (measured at commit bb823b3; never
vendored here), whose `Scheduler` + `BlockManager` run the same trace, timing `schedule()` +
`postprocess()`. Its package `__init__` imports the model runner (torch, flash-attn,
transformers) and its `config.py` imports transformers, so the bench registers a bare
`nanovllm` package (its `__path__` the checkout's `nanovllm/`, its `__init__` not run) and a
stand-in `nanovllm.config.Config` holding the fields the scheduler reads; `engine/scheduler.py`,
`engine/block_manager.py`, `engine/sequence.py` and `sampling_params.py` are nano-vllm's own.
Its block manager needs `xxhash` (not a project dependency: `pip install --target DIR xxhash`
and put DIR on PYTHONPATH).

What each side's timed calls do (the work is not the same, and the difference is in nano-vllm's favour):
ours writes the step's protobuf `StepPlan` (an entry per scheduled sequence, each new sequence's tokens
and parameters, block ids), reads the worker's `StepResult` (upb repeated fields) and builds a
`TokenOutput` per sampled token, as the service uses it; nano-vllm's `schedule()` returns its list of
sequences (its model runner turns them into tensors outside these calls) and `postprocess()` appends
the tokens (its engine builds outputs, for finished sequences only, outside them). Both keep block
tables, reference counts and prefix-cache hashes (blake2b here, xxhash there). nano-vllm does not mix
prompts and decodes in a step and chunks only the first prompt of one; ours does both.

The garbage collector runs as in the services (`hetero_common.gc_tuning.tune_gc`: the start-up heap
frozen, a young pass every 50,000 allocations), for both schedulers alike: it is one setting of the
process. `--default-gc` keeps CPython's defaults instead.

Our `Config` allows block sizes up to 128 (the worker's kernels); the scheduler itself has no
such limit, so for larger sizes the bench validates the config at 128 and then sets the size.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import random
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, worker_pb2  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.gc_tuning import tune_gc  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler  # noqa: E402
from scheduler_svc.core.step_plan import plan_needs_worker  # noqa: E402

EOS = 2
VOCAB = 32000
BATCH_BUCKETS = (1, 8, 32, 128, 256, 512)  # lower bounds of the batch-size buckets reported


@dataclass
class Request:
    arrival_step: int
    prompt: list[int]
    max_tokens: int


def make_trace(num_requests: int, seed: int, arrivals: str, rate: float) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(512)] for _ in range(8)]
    trace = []
    for i in range(num_requests):
        length = rng.randint(32, 1024)
        if rng.random() < 0.25:  # shares a prefix: 512 shared tokens and its own tail
            prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(max(1, length - 512))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        arrival = 0 if arrivals == "all" else int(i / rate)
        trace.append(Request(arrival, prompt, rng.randint(16, 256)))
    return trace


def ample_blocks(trace: list[Request], block_size: int) -> int:
    return sum(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in trace)


@dataclass
class Timing:
    seconds: float = 0.0
    steps: int = 0
    seq_steps: int = 0
    preemptions: int = 0
    by_batch: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [seconds, seq-steps]

    def add(self, seconds: float, batch: int) -> None:
        self.seconds += seconds
        self.steps += 1
        self.seq_steps += batch
        bucket = max(b for b in BATCH_BUCKETS if b <= max(batch, 1))
        entry = self.by_batch.setdefault(bucket, [0.0, 0])
        entry[0] += seconds
        entry[1] += batch

    @property
    def us_per_step(self) -> float:
        return 1e6 * self.seconds / max(self.steps, 1)

    @property
    def us_per_seq_step(self) -> float:
        return 1e6 * self.seconds / max(self.seq_steps, 1)


def next_token(rng: random.Random) -> int:
    return rng.randrange(3, VOCAB)  # never EOS (2): requests end by length, the same in both schedulers


# ------------------------------------------------------------------------------- ours

def run_ours(trace: list[Request], num_blocks: int, args: argparse.Namespace) -> Timing:
    config = Config(block_size=min(args.block_size, 128), max_batch_size=args.max_seqs, max_num_seqs=args.max_seqs,
                    max_total_tokens=args.max_tokens, max_model_len=4096, memory_threshold=1.0,
                    max_prefill_chunk_tokens=0, preemption_mode="recompute").validate()
    config.block_size = args.block_size
    s = Scheduler(config, num_blocks, (EOS,), max_model_len=4096)
    rng = random.Random(1)
    timing = Timing()
    pending = list(reversed(trace))
    step = 0
    clock = time.perf_counter
    gc.collect()
    while pending or s.has_pending_work():
        if not s.has_pending_work() and pending[-1].arrival_step > step:
            step = pending[-1].arrival_step  # nothing to do until the next arrival
        while pending and pending[-1].arrival_step <= step:
            r = pending.pop()
            s.add_request(f"r{len(trace) - len(pending)}", r.prompt,
                          common_pb2.SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
        start = clock()
        plan = s.schedule()
        elapsed = clock() - start
        if plan_needs_worker(plan):
            sampled = [x.seq_id for x in plan.scheduled if x.sample]
            result = worker_pb2.StepResult(step_id=plan.step_id, seq_ids=sampled,
                                           token_ids=[next_token(rng) for _ in sampled])
            start = clock()
            s.process_result(result)
            elapsed += clock() - start
        timing.add(elapsed, len(plan.scheduled))
        step += 1
    timing.preemptions = s.num_preemptions
    return timing


# ------------------------------------------------------------------------------- nano-vllm

def import_nano_vllm(checkout: Path) -> types.SimpleNamespace:
    """nano-vllm's scheduler modules, without running its package __init__ (see the module doc)."""
    package_dir = checkout / "nanovllm"
    if not (package_dir / "engine" / "scheduler.py").is_file():
        sys.exit(f"--nano-vllm {checkout}: no nanovllm/engine/scheduler.py there; pass a nano-vllm checkout")
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(package_dir)]
    sys.modules["nanovllm"] = package
    config_module = types.ModuleType("nanovllm.config")

    @dataclass
    class NanoConfig:  # the fields nano-vllm's Scheduler reads from its Config
        max_num_batched_tokens: int
        max_num_seqs: int
        eos: int
        kvcache_block_size: int
        num_kvcache_blocks: int

    config_module.Config = NanoConfig
    sys.modules["nanovllm.config"] = config_module
    try:
        scheduler = importlib.import_module("nanovllm.engine.scheduler")
    except ModuleNotFoundError as e:
        sys.exit(f"nano-vllm's scheduler needs {e.name!r}: pip install --target DIR {e.name}, then PYTHONPATH=DIR")
    sequence = importlib.import_module("nanovllm.engine.sequence")
    sampling = importlib.import_module("nanovllm.sampling_params")
    return types.SimpleNamespace(Config=NanoConfig, Scheduler=scheduler.Scheduler, Sequence=sequence.Sequence,
                                 SamplingParams=sampling.SamplingParams)


def run_nano(nano: types.SimpleNamespace, trace: list[Request], num_blocks: int, args: argparse.Namespace) -> Timing:
    nano.Sequence.block_size = args.block_size  # a class attribute there, set from its config by its engine
    config = nano.Config(max_num_batched_tokens=args.max_tokens, max_num_seqs=args.max_seqs, eos=-1,
                         kvcache_block_size=args.block_size, num_kvcache_blocks=num_blocks)
    s = nano.Scheduler(config)
    rng = random.Random(1)
    timing = Timing()
    pending = list(reversed(trace))
    step = 0
    clock = time.perf_counter
    preempt = s.preempt

    def counting_preempt(seq) -> None:  # nano-vllm keeps no count; wrapped outside the timed calls' cost
        timing.preemptions += 1
        preempt(seq)

    s.preempt = counting_preempt
    gc.collect()
    while pending or not s.is_finished():
        if s.is_finished() and pending[-1].arrival_step > step:
            step = pending[-1].arrival_step
        while pending and pending[-1].arrival_step <= step:
            r = pending.pop()
            s.add(nano.Sequence(r.prompt, nano.SamplingParams(temperature=1.0, max_tokens=r.max_tokens,
                                                              ignore_eos=True)))
        start = clock()
        seqs, is_prefill = s.schedule()
        elapsed = clock() - start
        tokens = [next_token(rng) for _ in seqs]
        start = clock()
        s.postprocess(seqs, tokens, is_prefill)
        elapsed += clock() - start
        timing.add(elapsed, len(seqs))
        step += 1
    return timing


# ------------------------------------------------------------------------------- report

def best_of(repeat: int, fn) -> Timing:
    return min((fn() for _ in range(repeat)), key=lambda t: t.seconds)


def describe(name: str, t: Timing) -> str:
    buckets = "  ".join(f"{b}+:{1e6 * sec / max(n, 1):.2f}" for b, (sec, n) in sorted(t.by_batch.items()))
    return (f"  {name:10}{t.steps:>7}{t.seq_steps:>10}{t.preemptions:>8}{t.us_per_step:>11.1f}{t.us_per_seq_step:>10.2f}"
            f"   {buckets}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--pool", choices=("ample", "tight", "both"), default="both")
    p.add_argument("--arrivals", choices=("all", "trickle", "both"), default="both")
    p.add_argument("--rate", type=float, default=2.0, help="requests arriving per step when trickling")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=512, help="sequences per step")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nano-vllm", type=Path, default=None, help="a nano-vllm checkout to compare with")
    p.add_argument("--default-gc", action="store_true", help="CPython's collector settings, not the services' ones")
    args = p.parse_args()
    configure_logging("warning", "console", "bench")  # preemptions log at info
    nano = import_nano_vllm(args.nano_vllm) if args.nano_vllm else None
    if not args.default_gc:
        tune_gc()
    pools = ("ample", "tight") if args.pool == "both" else (args.pool,)
    arrivals = ("all", "trickle") if args.arrivals == "both" else (args.arrivals,)
    print(f"{args.requests} requests, block size {args.block_size}, {args.max_seqs} seqs and {args.max_tokens} tokens "
          f"per step, seed {args.seed}, best of {args.repeat}, {'default' if args.default_gc else 'services’'} GC; "
          "µs per sequence-step by batch size after the figures")
    for arrival in arrivals:
        trace = make_trace(args.requests, args.seed, arrival, args.rate)
        ample = ample_blocks(trace, args.block_size)
        for pool in pools:
            num_blocks = ample if pool == "ample" else ample // 4
            rate = f" ({args.rate:g}/step)" if arrival == "trickle" else ""
            print(f"\narrivals {arrival}{rate}, pool {pool} ({num_blocks} blocks)")
            print(f"  {'':10}{'steps':>7}{'seq-steps':>10}{'preempt':>8}{'µs/step':>11}{'µs/seq':>10}")
            ours = best_of(args.repeat, lambda: run_ours(trace, num_blocks, args))
            print(describe("hetero", ours), flush=True)
            if nano is not None:
                theirs = best_of(args.repeat, lambda: run_nano(nano, trace, num_blocks, args))
                print(describe("nano-vllm", theirs))
                print(f"  ours / nano-vllm per sequence-step: {ours.us_per_seq_step / theirs.us_per_seq_step:.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
