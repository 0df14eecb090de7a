"""The accuracy oracle of quantized serving (issue 39): a model served one way against the same weights
dequantized and run in float32, on
- the mean negative log-likelihood of a fixed text (the first `--tokens` tokens of docs/architecture.md, its
  git blob id printed: compare figures of one run only), each token scored given all before it;
- greedy outputs of the oracle prompts (hetero_infer/bench/harness.py's 16 ORACLE_PROMPTS, chat-templated,
  `--new-tokens` each): the share of tokens before the first divergence from the float32 run.

    python benchmarks/quant_accuracy.py [--model FILE.gguf] [--tokens 2048] [--new-tokens 24]
                                        [--arm "LABEL|KEY=VALUE,..."] ...

Arms (config overrides of the engine's defaults) default to bfloat16 dequantized (`quantization=none`) and
the GGUF blocks (`quantization=auto`); the float32 reference is `dtype=float32,quantization=none`. An fp8 KV
cache: `--arm "fp8 KV|quantization=none,kv_cache_dtype=fp8"`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_common.tokenizer import load_tokenizer  # noqa: E402
from hetero_infer.engine import GenerationParams, InferenceEngine  # noqa: E402
from hetero_infer.bench.harness import ORACLE_PROMPTS as PROMPTS  # noqa: E402
from kernels.cache_ops import allocate_kv_cache  # noqa: E402
from kernels.page_table import PageTable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "docs" / "architecture.md"
CHUNK, BLOCK = 256, 16


def mean_nll(engine: InferenceEngine, tokens: list[int]) -> float:
    """Mean -log p(token | all before it) over tokens[1:], the text fed in chunks of CHUNK through the engine's
    model, attention backend and a KV cache of its own."""
    runner, model = engine.runner, engine.runner.model
    c = model.config
    blocks = (len(tokens) + BLOCK - 1) // BLOCK
    cache = allocate_kv_cache(c.num_hidden_layers, blocks, BLOCK, model.num_kv_heads, c.head_dim, runner.kv_dtype,
                              "cpu", runner.attention.kv_layout)
    table = np.arange(blocks, dtype=np.int32)
    total, done = 0.0, 0
    with torch.inference_mode():
        while done < len(tokens):
            n = min(CHUNK, len(tokens) - done)
            plan = PageTable.build([table], np.array([n]), np.array([done + n]), BLOCK)
            runner.attention.plan(plan)
            positions, slots = plan.token_positions()
            logits = model.forward(torch.tensor(tokens[done:done + n]), torch.from_numpy(positions),
                                   torch.from_numpy(slots), cache, runner.attention, torch.arange(n))
            logp = torch.log_softmax(logits.double(), dim=-1)
            targets = tokens[done + 1:done + n + 1]
            total -= float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())
            done += n
    return total / (len(tokens) - 1)


def greedy(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in prompts]
    done = {r.request_id: r.output_token_ids for r in engine.run()}
    return [done[i] for i in ids]


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    label, _, pairs = text.partition("|")
    return label, dict(p.split("=", 1) for p in pairs.split(",") if p)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--arm", action="append", default=None, help='"LABEL|key=value,..." (repeatable)')
    args = parser.parse_args()
    configure_logging("warning", "console")
    arms = [parse_arm(a) for a in args.arm or ["bfloat16 dequantized|quantization=none", "GGUF blocks|quantization=auto"]]
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    blob = subprocess.run(["git", "hash-object", str(TEXT)], capture_output=True, text=True).stdout.strip()
    tokens = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[: args.tokens]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                add_special_tokens=False) for p in PROMPTS]
    print(cpu_line())
    print(f"{path.name}; text: {TEXT.relative_to(REPO)} (blob {blob[:12]}), {len(tokens)} tokens; "
          f"{len(prompts)} prompts x {args.new_tokens} greedy tokens")

    def engine(overrides: dict[str, str]) -> InferenceEngine:
        return InferenceEngine(Config(model=args.model, block_size=BLOCK, **overrides).validate())

    reference = engine({"dtype": "float32", "quantization": "none"})
    ref_nll, ref_out = mean_nll(reference, tokens), greedy(reference, prompts, args.new_tokens)
    del reference
    print(f"{'float32 dequantized':<24} NLL {ref_nll:.5f} (ppl {math.exp(ref_nll):.3f})")
    for label, overrides in arms:
        eng = engine(overrides)
        nll, out = mean_nll(eng, tokens), greedy(eng, prompts, args.new_tokens)
        agreed = sum(next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(out, ref_out))
        print(f"{label:<24} NLL {nll:.5f} ({(nll / ref_nll - 1) * 100:+.2f}% of float32's); greedy tokens before "
              f"the first divergence {agreed}/{len(prompts) * args.new_tokens} "
              f"({agreed / (len(prompts) * args.new_tokens):.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
