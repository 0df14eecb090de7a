"""Seeded random scenarios replayed through the real Scheduler, every decision written down:
the proof that a change to the scheduler's code changed none of its behaviour.

    PYTHONPATH=<a checkout> python tests/helpers/scheduler_replay.py [--scenarios 300] [--out FILE]

Each scenario picks a configuration (block size, budgets, chunking, prefix caching and its
eviction policy, preemption mode, pool size) and a random interleaving of submissions (n = 1..3,
shared prefixes, cache salts, logprobs, stop tokens), steps, aborts (whole requests and single
samples), suspend/resume in each mode and replica recovery (take everything back, adopt it
again). A fake worker samples seeded random tokens (EOS among them) with logprobs and top
logprobs. Written for every step: the StepPlan (deterministic protobuf bytes), every TokenOutput
but its wall-clock fields, and the PoolStats. The script prints a SHA-256 of it all; run it on
two checkouts (put the checkout first on PYTHONPATH) and compare the digests, or the `--out` files.
It uses only the scheduler's public methods, so it runs unchanged on older and newer code.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config

try:  # the layout with concept folders
    from scheduler_svc.core import scheduler as scheduler_module
    from scheduler_svc.core.step_plan import plan_needs_worker
except ImportError:  # the flat layout before it, so that the two digests can be compared
    from scheduler_svc import scheduler as scheduler_module  # type: ignore[no-redef]
    from scheduler_svc.step_plan import plan_needs_worker  # type: ignore[no-redef]
Scheduler = scheduler_module.Scheduler

EOS = 2
VOCAB = 12  # small, so that generated tokens repeat and prefixes meet in the cache


def random_config(rng: random.Random) -> tuple[Config, int]:
    block_size = rng.choice([1, 2, 4, 16])
    chunked = rng.random() < 0.8
    config = Config(block_size=block_size, max_batch_size=rng.choice([1, 3, 8, 64]),
                    max_num_seqs=rng.choice([2, 6, 64]), max_model_len=rng.choice([64, 128]),
                    max_total_tokens=rng.choice([8, 16, 64, 256]) if chunked else 256,
                    memory_threshold=rng.choice([0.5, 0.9, 1.0]), enable_chunked_prefill=chunked,
                    max_prefill_chunk_tokens=rng.choice([0, 3, 16]), enable_prefix_caching=rng.random() < 0.8,
                    prefix_caching_eviction_policy=rng.choice(["lru", "ref_zero"]),
                    preemption_mode=rng.choice(["recompute", "swap"])).validate()
    num_blocks = rng.choice([12, 24, 48, 400]) * 4 // block_size + 8
    return config, num_blocks


def fake_result(rng: random.Random, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
    sampled = [s.seq_id for s in plan.scheduled if s.sample]
    k = rng.choice([0, 0, 2])
    result = worker_pb2.StepResult(step_id=plan.step_id, seq_ids=sampled,
                                   token_ids=[rng.randrange(2, VOCAB) for _ in sampled])
    if rng.random() < 0.5:
        result.logprobs.extend(-rng.random() for _ in sampled)
    if k:
        result.num_top_logprobs = k
        result.top_token_ids.extend(rng.randrange(VOCAB) for _ in range(k * len(sampled)))
        result.top_logprobs.extend(-rng.random() for _ in range(k * len(sampled)))
    return result


def write_outputs(out: list[bytes], outputs) -> None:
    for o in outputs:  # timestamp and queue_seconds are wall-clock readings
        top = b"|".join(t.SerializeToString(deterministic=True) for t in o.top_logprobs)
        out.append(repr((o.request_id, list(o.token_ids), o.finish_reason, o.error, [round(x, 6) for x in o.logprobs],
                         o.index, o.cached_prompt_tokens, o.queue_seconds > 0)).encode() + top)


def step(s: Scheduler, rng: random.Random, out: list[bytes]) -> None:
    plan = s.schedule()
    out.append(b"plan " + plan.SerializeToString(deterministic=True))
    if plan_needs_worker(plan):
        write_outputs(out, s.process_result(fake_result(rng, plan)))
    out.append(b"pool " + s.pool_stats().SerializeToString(deterministic=True))


def scenario(seed: int, out: list[bytes]) -> None:
    rng = random.Random(seed)
    config, num_blocks = random_config(rng)
    out.append(repr((seed, num_blocks, sorted(vars(config).items(), key=str))).encode())
    s = Scheduler(config, num_blocks, (EOS,), max_model_len=config.max_model_len)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    submitted = 0
    for _ in range(rng.randint(20, 160)):
        op = rng.random()
        if op < 0.3:
            prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB)
                                                                             for _ in range(rng.randint(1, 30))]
            params = common_pb2.SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, n=rng.choice([1, 1, 2, 3]),
                                               logprobs=rng.choice([0, 0, 1, 2]), ignore_eos=rng.random() < 0.3)
            if rng.random() < 0.2:
                params.stop_token_ids.append(rng.randrange(3, VOCAB))
            if rng.random() < 0.3:
                params.seed = rng.randrange(1000)
            try:
                s.add_request(f"r{submitted}", prompt, params, cache_salt=rng.choice(["", "", "salt"]))
                out.append(b"added")
            except Exception as e:  # too long for the pool or max_model_len: the refusal is behaviour too
                out.append(f"refused {type(e).__name__}: {e}".encode())
            submitted += 1
        elif op < 0.85:
            step(s, rng, out)
        elif op < 0.93 and s.samples:
            rid = sorted(s.samples)[rng.randrange(len(s.samples))]
            index = rng.choice([None, 0, 1, 2])
            out.append(repr(("abort", rid, index, s.abort(rid, index=index))).encode())
        elif op < 0.97:
            mode = rng.choice(["persist", "offload", "recompute"])
            s.suspend(mode)
            step(s, rng, out)  # a suspended scheduler plans nothing
            s.resume()
        else:
            # Replica recovery: everything back for recompute, adopted again in arrival order.
            for seq in s.take_all_for_recompute():
                s.adopt(seq)
    for _ in range(3000):
        if not s.has_pending_work():
            break
        step(s, rng, out)
    out.append(repr(("end", s.num_preemptions, s.num_swap_outs, s.step_id, sorted(s.requests))).encode())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=int, default=300)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write every record, one per line, to this file")
    args = p.parse_args()
    import logging

    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    digest = hashlib.sha256()
    lines = 0
    sink = open(args.out, "wb") if args.out else None
    for seed in range(args.first_seed, args.first_seed + args.scenarios):
        out: list[bytes] = []
        scenario(seed, out)
        for record in out:
            digest.update(len(record).to_bytes(8, "little") + record)
            if sink:
                sink.write(record.hex().encode() + b"\n")
        lines += len(out)
    if sink:
        sink.close()
    print(f"scheduler from {scheduler_module.__file__}", file=sys.stderr)
    print(f"{args.scenarios} scenarios, {lines} records, sha256 {digest.hexdigest()}")


if __name__ == "__main__":
    main()
