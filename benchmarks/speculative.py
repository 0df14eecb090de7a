"""Speculative decoding (issue 40) against plain decoding on the in-process engine, in one run, the arms
alternating per round (same model, same prompts, greedy, EOS ignored):

    python benchmarks/speculative.py [--model M] [--rounds 3] [--new-tokens 128] [--requests 64]
                                     [--num-speculative-tokens 4] [--prompt-lookup-min 2] [--prompt-lookup-max 4]
                                     [--methods ngram,draft] [--draft-model DIR | --draft-layers 6] [--not-adaptive]

Arms: `none`, then each of `--methods`. `draft` proposes with `--draft-model`, or, with none given, with the
served model's first `--draft-layers` layers (its final norm and LM head kept: an early-exit draft written
to a temporary directory, the only draft with the same tokenizer that an offline machine has).

Three workloads:
- `copy`, batch 1: a passage of this repository (a source file's opening, a section of the docs), then its
  first lines again, so that the model goes on copying it: the output repeats spans of the prompt, where
  prompt lookup proposes well. Printed: time per output token (TPOT, median over the passages).
- `chat`, `--requests` at once: the 16 oracle prompts (hetero_infer/bench/harness.py's ORACLE_PROMPTS: questions,
  instructions, code, a story opening) in four framings each, as text: natural outputs, which repeat their
  prompt less. Printed: output tokens per second. Speculation must not cost throughput here.
- `random`, `--requests` at once: benchmarks/throughput.py's random prompts (16-256 tokens). A small model
  answers random tokens by looping, which lookups catch: printed, but not a workload "without repetition".
For each speculative arm, its acceptance (kept drafts / proposed), its mean tokens per drafted decode (1 + kept /
decodes with drafts), and whether its outputs equal the plain arm's token for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line  # noqa: E402
from benchmarks.workload import make_prompts, round_order  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from hetero_infer.bench.harness import ORACLE_PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PASSAGES = ["scheduler_svc/sequence.py", "kernels/native/linear_bf16.c", "docs/architecture.md", "gateway/text/stop_strings.py"]


def copy_prompts(engine: InferenceEngine, chars: int = 1600, again: int = 300) -> list[list[int]]:
    """Each passage's first `chars` characters, a blank line, then its first `again` characters again."""
    prompts = []
    for name in PASSAGES:
        text = (ROOT / name).read_text()[:chars]
        prompts.append(engine.tokenizer.encode(text + "\n\n" + text[:again]))
    return prompts


def early_exit_draft(model: str | None, layers: int, directory: Path) -> Path:
    """The served model's first `layers` layers, its embeddings, final norm and LM head, as a Hugging Face
    directory (bfloat16 safetensors)."""
    from gpu_worker.models.checkpoint import load_checkpoint
    from hetero_infer.bench.harness import save_checkpoint

    mc, weights = load_checkpoint(resolve_model_path(model))
    kept = {name: t for name, t in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    return save_checkpoint(mc, kept, directory, num_hidden_layers=layers)


def chat_prompts(engine: InferenceEngine, count: int) -> list[list[int]]:
    """`count` natural prompts: the oracle prompts in four framings, as many as asked."""
    framings = ["{}\n", "Question: {}\nAnswer:", "User: {}\nAssistant:", "Please reply to this: {}\n\n"]
    texts = [f.format(p) for f in framings for p in ORACLE_PROMPTS]
    return [engine.tokenizer.encode(texts[i % len(texts)]) for i in range(count)]


def generate(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]], list[list[int]]]:
    """All prompts at once: (wall seconds, each request's token arrival times, each one's tokens)."""
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.submit_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_pending_work():
        engine.step()
        now = time.perf_counter() - start
        for out in engine.last_step_outputs:
            times[out.request_id].extend([now] * len(out.token_ids))
            tokens[out.request_id].extend(out.token_ids)
    return time.perf_counter() - start, [times[i] for i in ids], [tokens[i] for i in ids]


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--methods", default="ngram", help="speculative arms, comma-separated: ngram, draft")
    parser.add_argument("--draft-model", default=None, help="`draft`'s model (default: an early-exit draft)")
    parser.add_argument("--draft-layers", type=int, default=6, help="the early-exit draft's layers")
    parser.add_argument("--max-num-blocks", type=int, default=None,
                        help="each engine's KV pool cap (config max_num_blocks); unset, a CUDA pool takes what memory allows")
    parser.add_argument("--not-adaptive", action="store_true",
                        help="speculative_adaptive false: every decode proposes (a proposer's own acceptance)")
    args = parser.parse_args()
    configure_logging("warning")
    methods = args.methods.split(",")
    common = dict(model=args.model, max_batch_size=max(args.requests, 32), max_num_blocks=args.max_num_blocks)
    speculative = dict(num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_min=args.prompt_lookup_min,
                       prompt_lookup_max=args.prompt_lookup_max, speculative_adaptive=not args.not_adaptive)
    engines = {"none": InferenceEngine(Config(**common).validate())}
    scratch = tempfile.TemporaryDirectory()
    for method in methods:
        extra = {}
        if method == "draft":
            extra["speculative_model"] = args.draft_model or str(early_exit_draft(args.model, args.draft_layers,
                                                                                  Path(scratch.name)))
        engines[method] = InferenceEngine(Config(**common, **speculative, speculative_method=method, **extra).validate())
    copy = copy_prompts(engines["none"])
    batches = {"chat": chat_prompts(engines["none"], args.requests), "random": make_prompts(args.requests, 16, 256)}
    for engine in engines.values():  # warm-up: the kernels' first calls, the allocator
        generate(engine, [copy[0][:64]], 8)
    print(cpu_line())
    print(f"copy: {len(copy)} passages of {min(map(len, copy))}-{max(map(len, copy))} tokens, batch 1; chat and "
          f"random: {args.requests} requests at once; {args.new_tokens} greedy tokens each; {args.rounds} alternating "
          f"rounds, medians; k={args.num_speculative_tokens}, ngram n={args.prompt_lookup_min}..{args.prompt_lookup_max}"
          + (f", draft {args.draft_model or f'the first {args.draft_layers} layers'}" if "draft" in methods else ""))
    workloads = ["copy", *batches]
    figures: dict[str, dict[str, list[float]]] = {w: {name: [] for name in engines} for w in workloads}
    outputs: dict[str, dict[str, list[list[int]]]] = {name: {w: [] for w in workloads} for name in engines}
    stats = {name: {w: [0, 0, 0] for w in workloads} for name in methods}  # proposed, kept, drafted decodes
    for r in range(args.rounds):
        for name in round_order(list(engines), r):
            engine = engines[name]
            spec = engine.scheduler.speculator
            for workload in workloads:
                before = (spec.num_proposed, spec.num_accepted, spec.num_drafted_rows) if spec else (0, 0, 0)
                if workload == "copy":
                    per_passage = []
                    for p in copy:
                        _, times, toks = generate(engine, [p], args.new_tokens)
                        per_passage.append(tpot(times[0]) * 1e3)
                        outputs[name][workload].append(toks[0])
                    figures[workload][name].append(statistics.median(per_passage))
                else:
                    seconds, _, toks = generate(engine, batches[workload], args.new_tokens)
                    figures[workload][name].append(sum(map(len, toks)) / seconds)
                    outputs[name][workload].extend(toks)
                if spec:
                    after = (spec.num_proposed, spec.num_accepted, spec.num_drafted_rows)
                    stats[name][workload] = [s + a - b for s, a, b in zip(stats[name][workload], after, before)]
            print(f"  round {r + 1} {name:>6}: " + ", ".join(f"{w} {figures[w][name][-1]:.2f}" for w in workloads), flush=True)
    print(f"{'workload':<10}{'arm':<7}{'none':>14}{'arm':>14}{'ratio':>8}  acceptance     tokens/drafted decode  same output")
    for workload in workloads:
        unit = "ms/token" if workload == "copy" else "tok/s"
        none_v = statistics.median(figures[workload]["none"])
        for name in methods:
            arm_v = statistics.median(figures[workload][name])
            proposed, kept, rows = stats[name][workload]
            same = outputs["none"][workload] == outputs[name][workload]
            acceptance = f"{kept / proposed:.0%} of {proposed}" if proposed else "no proposals"
            per_row = f"{1 + kept / rows:.2f}" if rows else "-"
            print(f"{workload:<10}{name:<7}{none_v:>8.2f} {unit:<5}{arm_v:>8.2f} {unit:<5}{arm_v / none_v:>6.2f}x  "
                  f"{acceptance:<15}{per_row:>8}{'':>15}{'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
