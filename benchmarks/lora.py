"""Multi-LoRA serving (issue 41) against the base model on the in-process engine, in one run:

    python benchmarks/lora.py [--model M] [--rounds 3] [--requests 64] [--adapters 8] [--rank 16]
                              [--new-tokens 64] [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]

The workload: `--requests` random prompts (16-256 tokens, benchmarks/workload.py), greedy, EOS ignored, all at
once. Arms, alternating per round:
- `base`: every request on the base model;
- `lora`: the same requests spread over `--adapters` adapters of rank `--rank` (random weights, every target,
  written in PEFT's format), one engine holding them all (`lora_modules`), request i on adapter i mod N.
Then once, the comparison the issue names: one merged-weights model per adapter (base + scaling * B @ A),
each serving its own requests, one model after another (generation time only; loading not counted).
Printed: output tok/s of each arm, `lora` / `base` (the target: at least 0.8x), and `lora` / merged.
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
from hetero_common.config_sections import TokenizerConfig  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def run(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int, adapters: list[str]) -> tuple[float, int]:
    """All prompts at once, prompt i on adapters[i % len] ("" = the base): (seconds, output tokens)."""
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit_request(p, params, lora=adapters[i % len(adapters)])
    tokens = sum(len(r.output_token_ids) for r in engine.run())
    return time.perf_counter() - start, tokens


def merged_model(model: str | None, adapter: Path, directory: Path) -> Path:
    """The base model with the adapter merged into its weights, as a Hugging Face directory."""
    from gpu_worker.lora.lora_adapter import load_lora_adapter
    from gpu_worker.models.checkpoint import load_checkpoint
    from hetero_infer.bench.harness import module_name, save_checkpoint

    mc, weights = load_checkpoint(resolve_model_path(model))
    lora = load_lora_adapter(adapter.name, adapter, mc, max_rank=1024)
    for (layer, target), (a, b) in lora.weights.items():
        name = f"{module_name(layer, target)}.weight"
        weights[name] = weights[name].float() + lora.scaling * b @ a
    return save_checkpoint(mc, weights, directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-num-blocks", type=int, default=None,
                        help="each engine's KV pool cap (config max_num_blocks); unset, a CUDA pool takes what memory allows")
    parser.add_argument("--targets", default=TARGETS)
    args = parser.parse_args()
    configure_logging("warning")
    from gpu_worker.models.checkpoint import load_checkpoint
    from hetero_infer.bench.harness import write_random_lora

    scratch = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    mc, _ = load_checkpoint(resolve_model_path(args.model))
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = {n: write_random_lora(mc, scratch / n, args.rank, args.targets.split(","), seed=i)
             for i, n in enumerate(names)}
    common = dict(model=args.model, max_batch_size=max(args.requests, 32), max_num_blocks=args.max_num_blocks)
    engines = {"base": (InferenceEngine(Config(**common).validate()), [""]),
               "lora": (InferenceEngine(Config(**common, max_loras=args.adapters, max_lora_rank=args.rank,
                                               lora_modules=",".join(f"{n}={p}" for n, p in paths.items())).validate()),
                        names)}
    prompts = make_prompts(args.requests, 16, 256)
    for engine, adapters in engines.values():  # warm-up: the kernels' first calls, the allocator
        run(engine, prompts[:2], 4, adapters)
    print(cpu_line())
    print(f"{args.requests} requests of 16-256 random tokens, {args.new_tokens} greedy tokens each, all at once; "
          f"{args.adapters} adapters of rank {args.rank} on {args.targets}; {args.rounds} alternating rounds, medians")
    figures: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in round_order(list(engines), r):
            engine, adapters = engines[name]
            seconds, tokens = run(engine, prompts, args.new_tokens, adapters)
            figures[name].append(tokens / seconds)
            print(f"  round {r + 1} {name:>5}: {figures[name][-1]:.1f} tok/s", flush=True)
    del engines
    merged_seconds, merged_tokens = 0.0, 0
    tokenizer = TokenizerConfig(path=str(resolve_model_path(args.model)))
    for i, name in enumerate(names):  # one model per adapter, its own requests, one after another
        directory = merged_model(args.model, paths[name], scratch / f"merged-{i}")
        engine = InferenceEngine(Config(**{**common, "model": str(directory)}, tokenizer=tokenizer).validate())
        run(engine, prompts[:1], 4, [""])
        seconds, tokens = run(engine, prompts[i::args.adapters], args.new_tokens, [""])
        merged_seconds, merged_tokens = merged_seconds + seconds, merged_tokens + tokens
        del engine
    base, lora = statistics.median(figures["base"]), statistics.median(figures["lora"])
    merged = merged_tokens / merged_seconds
    print(f"base {base:.1f} tok/s, lora {lora:.1f} tok/s: {lora / base:.2f}x the base "
          f"(per round: {', '.join(f'{l / b:.2f}' for l, b in zip(figures['lora'], figures['base']))}); "
          f"merged models one after another {merged:.1f} tok/s: lora {lora / merged:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
