"""Benchmark prompts: synthetic (lengths drawn from a distribution) or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Plain words: each is usually one token in a BPE vocabulary, so a prompt of n words is ~n tokens.
WORDS = ("the of and to in is was for on that with as by at from his her an which have are were this be "
         "one all they their has been had not but more some time would when there what about can out other "
         "into only new first also after year many then them these two may over such most made like long "
         "city world water light music river house story market number family school garden paper").split()


@dataclass
class BenchRequest:
    prompt: str
    max_tokens: int


def _length(mean: int, spread: float, distribution: str, rng: random.Random) -> int:
    if distribution == "fixed" or spread == 0:
        return max(1, mean)
    if distribution == "uniform":
        return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))
    if distribution == "normal":
        return max(1, round(rng.gauss(mean, mean * spread)))
    raise ValueError(f"unknown length distribution {distribution!r} (fixed, uniform, normal)")


def synthetic(num: int, input_len: int, output_len: int, spread: float, distribution: str, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        words = [rng.choice(WORDS) for _ in range(_length(input_len, spread, distribution, rng))]
        out.append(BenchRequest(" ".join(words), _length(output_len, spread, distribution, rng)))
    return out


def from_jsonl(path: str | Path, num: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """Lines like {"prompt": "...", "max_tokens": 64}; max_tokens is optional."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{path}:{i + 1}: each line needs a \"prompt\"")
        out.append(BenchRequest(str(row["prompt"]), int(row.get("max_tokens", default_max_tokens))))
        if num is not None and len(out) >= num:
            break
    return out
