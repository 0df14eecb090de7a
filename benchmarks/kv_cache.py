"""KV cache depth, each feature off and on, side by side, in one run (in-process engine).

    python benchmarks/kv_cache.py [--model random-llama|smollm2|PATH] [--rate 4] [--requests 64] [--parts abcd]

(a) prefix caching: `--requests` requests sharing a 512-token system prompt, each with its own
    32-token question, arriving at `--rate` requests/s; prompt tokens actually computed, time
    to first token (from arrival) p50/p99, output tokens/s.
(b) chunked prefill: 16 streams decoding while a 2,000-token prompt arrives; the streams'
    inter-token latency p50/p99 while that prompt is prefilled.
(c) preemption: a workload needing 3x the pool's blocks, in recompute and swap mode:
    completes with no errors (and the same tokens as with a big pool), number of preemptions.
(d) internal waste at block sizes 8, 16, 32 for prompts of 100-1,000 tokens (block pool only).

The model is by default a seeded random Llama (8 layers, hidden 256, GQA 8/4 heads, built in a
temporary directory in seconds): SmolLM2-135M (`--model smollm2`) computes ~40 prompt tokens/s on
the shared 2-core machine, too slow for (a) with caching off (35k prompt tokens). Timings on a
shared machine are noisy; the token counts are exact.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero.v1 import common_pb2, worker_pb2  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_infer.bench.stats import percentile  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler  # noqa: E402


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


VOCAB = 40000


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]  # clear of SmolLM2's special tokens


def random_llama(directory: Path) -> Path:
    """A moderately sized seeded random Llama with a real BPE tokenizer (hetero_infer/bench/harness.py's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hetero_infer.bench.harness import make_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=0, tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).eval().save_pretrained(str(directory), safe_serialization=True)
    make_tokenizer(directory, vocab_size=384)
    return directory


class Counted:
    """Counts the tokens the worker actually computes (prefill and decode) through the real runner."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.computed = 0
        self._execute = engine.runner.execute
        engine.runner.execute = self  # type: ignore[method-assign]

    def __call__(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        self.computed += sum(s.num_tokens for s in plan.scheduled)
        return self._execute(plan)


def make_engine(runner, tokenizer, **overrides) -> InferenceEngine:
    config = Config(model=ARGS.model, **overrides).validate()
    return InferenceEngine(config, runner=runner, tokenizer=tokenizer)


# ------------------------------------------------------------------------------- (a)

def part_a(runner, tokenizer) -> list[str]:
    rng = random.Random(0)
    system = tokens(rng, 512)
    prompts = [system + tokens(rng, 32) for _ in range(ARGS.requests)]
    new_tokens = 16
    rows = {}
    for caching in (False, True):
        engine = make_engine(runner, tokenizer, enable_prefix_caching=caching)
        counter = Counted(engine)
        params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        arrivals = [start + i / ARGS.rate for i in range(len(prompts))]
        arrived: dict[str, float] = {}
        ttft: dict[str, float] = {}
        submitted = 0
        generated = 0
        while submitted < len(prompts) or engine.has_pending_work():
            now = time.perf_counter()
            while submitted < len(prompts) and arrivals[submitted] <= now:
                rid = engine.submit_request(prompts[submitted], params)
                arrived[rid] = arrivals[submitted]
                submitted += 1
            if not engine.has_pending_work():
                time.sleep(max(0.0, arrivals[submitted] - time.perf_counter()))
                continue
            engine.step()
            t = time.perf_counter()
            for out in engine.last_step_outputs:
                generated += len(out.token_ids)
                ttft.setdefault(out.request_id, t - arrived[out.request_id])
        elapsed = time.perf_counter() - start
        decode_tokens = generated - len(prompts)  # every generated token but each request's last is computed
        stats = engine.get_memory_stats()
        rows[caching] = dict(computed=counter.computed - decode_tokens, p50=pct(list(ttft.values()), 50),
                             p99=pct(list(ttft.values()), 99), tps=generated / elapsed,
                             hits=stats.prefix_cache_hits, queries=stats.prefix_cache_queries)
        runner.kv_cache.zero_()
    off, on = rows[False], rows[True]
    out = [f"(a) prefix caching: {ARGS.requests} requests = 512-token shared system prompt + 32-token question, "
           f"{new_tokens} new tokens each, arriving at {ARGS.rate:g}/s",
           f"    {'':28}{'off':>12}{'on':>12}{'off/on':>10}",
           f"    {'prompt tokens computed':28}{off['computed']:>12}{on['computed']:>12}{off['computed'] / max(1, on['computed']):>9.1f}x",
           f"    {'TTFT p50 (s)':28}{off['p50']:>12.3f}{on['p50']:>12.3f}{off['p50'] / on['p50']:>9.1f}x",
           f"    {'TTFT p99 (s)':28}{off['p99']:>12.3f}{on['p99']:>12.3f}{off['p99'] / on['p99']:>9.1f}x",
           f"    {'output tokens/s':28}{off['tps']:>12.1f}{on['tps']:>12.1f}{on['tps'] / off['tps']:>9.1f}x (on/off)",
           f"    {'prefix cache hits/queries':28}{'-':>12}{on['hits']:>6}/{on['queries']}"]
    return out


# ------------------------------------------------------------------------------- (b)

def part_b(runner, tokenizer) -> list[str]:
    rng = random.Random(1)
    streams = [tokens(rng, 32) for _ in range(16)]
    long_prompt = tokens(rng, 2000)
    trials: dict[str, list[dict]] = {"off": [], "on": []}
    settings = {"off": dict(enable_chunked_prefill=False, max_total_tokens=4096),
                "on": dict(enable_chunked_prefill=True, max_prefill_chunk_tokens=ARGS.chunk)}
    # Trials alternate off/on so a burst of load from other processes hits both; medians are reported.
    for name, overrides in [item for _ in range(ARGS.trials) for item in settings.items()]:
        engine = make_engine(runner, tokenizer, max_model_len=2560, enable_prefix_caching=False, **overrides)
        params = GenerationParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        ids = [engine.submit_request(p, params) for p in streams]
        last: dict[str, float] = {}
        gaps: list[float] = []
        window_start = None
        long_id = None
        for step in range(10_000):
            engine.step()
            t = time.perf_counter()
            for out in engine.last_step_outputs:
                if out.request_id == long_id:
                    continue
                if window_start is not None and out.request_id in last:
                    gaps.append(t - last[out.request_id])
                last[out.request_id] = t
            if long_id and any(o.request_id == long_id for o in engine.last_step_outputs):
                break  # the long prompt's first token: its prefill is over
            if step == 5:  # the streams are decoding: the long prompt arrives
                long_id = engine.submit_request(long_prompt, GenerationParams(max_tokens=4, temperature=0.0))
                window_start = t
        prefill_s = time.perf_counter() - window_start
        for rid in ids + [long_id]:
            engine.abort(rid)
        trials[name].append(dict(p50=pct(gaps, 50), p99=pct(gaps, 99), prefill=prefill_s))
    off, on = ({k: statistics.median(t[k] for t in trials[name]) for k in ("p50", "p99", "prefill")} for name in ("off", "on"))
    return [f"(b) chunked prefill: 16 streams decoding while a 2,000-token prompt arrives (chunk cap {ARGS.chunk} tokens; "
            f"median of {ARGS.trials} trials)",
            f"    {'':28}{'off':>12}{'on':>12}{'off/on':>10}",
            f"    {'ITL p50 during prefill (s)':28}{off['p50']:>12.3f}{on['p50']:>12.3f}{off['p50'] / on['p50']:>9.1f}x",
            f"    {'ITL p99 during prefill (s)':28}{off['p99']:>12.3f}{on['p99']:>12.3f}{off['p99'] / on['p99']:>9.1f}x",
            f"    {'long prompt TTFT (s)':28}{off['prefill']:>12.3f}{on['prefill']:>12.3f}"]


# ------------------------------------------------------------------------------- (c)

def part_c(runner, tokenizer) -> list[str]:
    rng = random.Random(2)
    pool_blocks, prompt_len, new_tokens = 64, 64, 64
    count = 3 * pool_blocks * 16 // (prompt_len + new_tokens)  # 3x the pool's blocks in all
    prompts = [tokens(rng, prompt_len) for _ in range(count)]
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in ("big pool", "recompute", "swap"):
        blocks = runner.num_blocks if mode == "big pool" else pool_blocks
        engine = make_engine(runner, tokenizer, max_num_blocks=blocks, enable_prefix_caching=False,
                             preemption_mode="recompute" if mode == "big pool" else mode)
        start = time.perf_counter()
        ids = [engine.submit_request(p, params) for p in prompts]
        done = {r.request_id: r for r in engine.run()}
        results[mode] = dict(outputs=[done[i].output_token_ids for i in ids], seconds=time.perf_counter() - start,
                             errors=sum(r.finish_reason == "error" for r in done.values()),
                             preemptions=engine.scheduler.num_preemptions, swaps=engine.scheduler.num_swap_outs)
    lines = [f"(c) preemption: {count} requests x ({prompt_len} prompt + {new_tokens} new tokens) = "
             f"{count * (prompt_len + new_tokens) // 16} blocks of 16 on a {pool_blocks}-block pool (3x)",
             f"    {'mode':12}{'errors':>8}{'preemptions':>13}{'swap-outs':>11}{'seconds':>9}  same tokens as big pool"]
    for mode, r in results.items():
        same = r["outputs"] == results["big pool"]["outputs"]
        lines.append(f"    {mode:12}{r['errors']:>8}{r['preemptions']:>13}{r['swaps']:>11}{r['seconds']:>9.1f}  {same}")
    return lines


# ------------------------------------------------------------------------------- (d)

def part_d() -> list[str]:
    rng = random.Random(3)
    lengths = [rng.randint(100, 1000) for _ in range(200)]
    lines = ["(d) internal waste (allocated slots not holding a token / allocated slots), 200 prompts of 100-1,000 tokens"]
    for bs in (8, 16, 32):
        config = Config(block_size=bs, max_total_tokens=1 << 20, max_batch_size=1024, max_num_seqs=1024,
                        max_model_len=2048, enable_prefix_caching=False, max_prefill_chunk_tokens=0).validate()
        s = Scheduler(config, 1 << 16, (2,), max_model_len=2048)
        for i, n in enumerate(lengths):
            s.add_request(f"r{i}", tokens(rng, n), common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
        plan = s.schedule()  # every prompt admitted and computed in one step
        sampled = [x.seq_id for x in plan.scheduled if x.sample]
        s.process_result(worker_pb2.StepResult(step_id=plan.step_id, seq_ids=sampled, token_ids=[7] * len(sampled)))
        lines.append(f"    block size {bs:>2}: {100 * s.pool_stats().internal_waste:5.2f}%")
    return lines


def main() -> None:
    from gpu_worker.runner import ModelRunner
    from hetero_common.tokenizer import load_tokenizer

    global VOCAB
    configure_logging("warning", "console", "bench")
    parts = ARGS.parts
    if ARGS.model == "smollm2":
        ARGS.model = None
    elif ARGS.model == "random-llama":
        ARGS.model = str(random_llama(Path(tempfile.mkdtemp(prefix="kv-bench-"))))
        VOCAB = 384
    lines = []
    if set(parts) & set("abc"):
        runner = ModelRunner(Config(model=ARGS.model, max_num_blocks=1024, max_model_len=2560).validate())
        tokenizer = load_tokenizer(runner.model_path, None)
        lines.append(f"model: {runner.model_path.name} ({runner.model_config.architecture}, "
                     f"{runner.model_config.num_hidden_layers} layers), {runner.device}, {os.cpu_count()} cores; "
                     "in-process engine")
        warm = make_engine(runner, tokenizer)
        warm.submit_request(tokens(random.Random(9), 64), GenerationParams(max_tokens=4, temperature=0.0))
        warm.run()
        for part, fn in (("a", part_a), ("b", part_b), ("c", part_c)):
            if part in parts:
                lines += fn(runner, tokenizer)
                if ARGS.verbose:
                    print("\n".join(lines), flush=True)
    if "d" in parts:
        lines += part_d()
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-llama", help="random-llama (default) | smollm2 | a checkpoint path")
    parser.add_argument("--rate", type=float, default=4.0, help="(a) request arrivals per second")
    parser.add_argument("--requests", type=int, default=64, help="(a) requests")
    parser.add_argument("--chunk", type=int, default=Config().max_prefill_chunk_tokens, help="(b) prefill chunk cap")
    parser.add_argument("--trials", type=int, default=5, help="(b) alternating off/on trials")
    parser.add_argument("--parts", default="abcd")
    parser.add_argument("--verbose", action="store_true")
    ARGS = parser.parse_args()
    main()
