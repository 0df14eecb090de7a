"""Constrained decoding's cost: the mask time per row per step, and the stack's throughput with half the
rows constrained next to the same run unconstrained.

    python benchmarks/constrained.py [--model PATH] [--requests 64] [--new-tokens 64] [--repeats 2]
                                     [--dtype auto] [--rows 32]

1. Mask time, in-process on the served tokenizer: `--rows` matchers of a JSON Schema stepped through a
   valid document, timed as the worker runs them (gpu_worker/constrained.py: the bitmask filled by each
   matcher, expanded to the logits' width, then each matcher consuming its token), per row and step.
2. The stack (`hetero-infer serve`): `--requests` concurrent gRPC requests of `--new-tokens` tokens at
   temperature 1 (seeded). Unconstrained: every request ignores EOS. Constrained: half of them carry a JSON
   Schema whose documents are longer than `--new-tokens` (a 40-string array), so every row makes the same
   number of tokens in both runs and the difference is the constraint's cost. Output tokens/s per run,
   the best of `--repeats` alternating runs, and the constrained run's loss.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetero_common.tokenizer import load_tokenizer  # noqa: E402
from gpu_worker.constrained import GuidanceVocabulary, build_constraint_masks  # noqa: E402
from hetero.v1 import common_pb2, inference_pb2  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_common.sampling import resolve  # noqa: E402
from hetero_infer.testing.stack import Stack, run_stack  # noqa: E402

LONG = {"type": "array", "items": {"type": "string", "minLength": 6, "maxLength": 12}, "minItems": 40, "maxItems": 40}
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}
DOCUMENT = {"name": "Alice Smith", "age": 42, "tags": ["red", "blue"]}


class Row:
    def __init__(self, params: common_pb2.SamplingParams) -> None:
        self.sampling, self.token_ids, self.num_generated, self.controls, self.constraint = resolve(params), [1], 0, None, None


def mask_time(model: Path, rows: int) -> tuple[float, float, int]:
    """(build seconds of llguidance's tokenizer, microseconds per row per step, steps)."""
    tokenizer = load_tokenizer(model)
    width = tokenizer.vocab_size
    vocabulary = GuidanceVocabulary(tokenizer.tokenizer.to_str, list(tokenizer.eos_token_ids), width)
    started = time.perf_counter()
    assert vocabulary.tokenizer is not None, vocabulary.error
    build = time.perf_counter() - started
    doc = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    states = [Row(common_pb2.SamplingParams(json_schema=json.dumps(RECORD))) for _ in range(rows)]
    build_constraint_masks(states, range(rows), width, vocabulary, torch.device("cpu"))  # matchers built, nothing consumed
    timings = []
    for token in doc:
        started = time.perf_counter()
        masks = build_constraint_masks(states, range(rows), width, vocabulary, torch.device("cpu"))
        assert masks is not None and bool(masks.allowed[:, token].all()) and masks.advance([token] * rows) == []
        timings.append(time.perf_counter() - started)
    return build, statistics.median(timings) / rows * 1e6, len(doc)


def requests(n: int, new_tokens: int, constrained: bool) -> list[inference_pb2.GenerateRequest]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 128))]
        params = common_pb2.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i)
        if constrained and i % 2:
            params.json_schema = json.dumps(LONG)
        else:
            params.ignore_eos = True
        out.append(inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), params=params))
    return out


def throughput(stack: Stack, batch: list[inference_pb2.GenerateRequest]) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda r: stack.inference.Complete(r, timeout=600), batch))
    elapsed = time.perf_counter() - started
    assert all(a.finish_reason == common_pb2.FINISH_REASON_LENGTH for a in answers)  # same token counts
    return sum(a.usage.completion_tokens for a in answers) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=32)
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    build, per_row, steps = mask_time(model, args.rows)
    print(f"llguidance tokenizer built in {build:.3f} s; JSON-schema mask: {per_row:.1f} us per row per step "
          f"(median over {steps} steps, {args.rows} rows, mask fill + expansion + consume)")
    runs: dict[bool, list[float]] = {False: [], True: []}
    with run_stack(model if args.model else None, "--dtype", args.dtype) as stack:
        throughput(stack, requests(8, 8, True))  # warm-up: both paths, and llguidance's tokenizer in each process
        for _ in range(args.repeats):
            for constrained in (False, True):
                runs[constrained].append(throughput(stack, requests(args.requests, args.new_tokens, constrained)))
    plain, constrained = max(runs[False]), max(runs[True])
    print(f"{args.requests} requests x {args.new_tokens} tokens, best of {args.repeats}: unconstrained "
          f"{plain:.1f} tok/s, half constrained {constrained:.1f} tok/s ({(1 - constrained / plain) * 100:+.1f}% loss)")
    print(f"runs: unconstrained {[round(x, 1) for x in runs[False]]}, constrained {[round(x, 1) for x in runs[True]]}")


if __name__ == "__main__":
    main()
