"""The workload that benchmarks/throughput.py runs on every system, and how its latencies are summed up:
TPOT and percentiles as `hetero-infer bench` computes them (hetero_infer/bench/stats.py).

benchmarks/vllm_driver.py, which runs in vLLM's own virtual environment without the project's packages,
does not import this module: it hands back each request's TTFT and TPOT, summed up by `from_latencies`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence, TypeVar

from hetero_infer.bench.stats import summary, time_per_output_token

SMOLLM2_VOCAB = 49152
# Skip the low ids, where SmolLM2 keeps its special tokens: a random EOS would not stop us
# (EOS is ignored) but a chat-control token in the prompt is not a realistic input.
LOWEST_ID = 100


def make_prompts(n: int, lo: int, hi: int, vocab: int = SMOLLM2_VOCAB, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random token ids, lengths uniform in [lo, hi]; the same for every system (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(LOWEST_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@dataclass
class RequestTiming:
    """One request's token arrival times, in seconds from the moment it was submitted."""

    token_times: list[float] = field(default_factory=list)  # one entry per token (a chunk's tokens share one)

    def add(self, t: float, n_tokens: int = 1) -> None:
        self.token_times.extend([t] * n_tokens)

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def tpot(self) -> float | None:
        times = self.token_times
        return time_per_output_token(times[0], times[-1], len(times)) if times else None


T = TypeVar("T")


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order of a round of an A/B: every other round reversed, so that the machine's drift over the run
    (this VM's speed wanders by ±15% within minutes) favours none of them."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


@dataclass
class Result:
    """One system's run of the workload: what the tables print and --json writes."""

    seconds: float
    output_tokens: int
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    tpot_mean: float | None = None
    tpot_p50: float | None = None
    note: str = ""  # how the figures were taken, when it differs from the others
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_per_s": self.tok_per_s}


def from_latencies(seconds: float, output_tokens: int, ttfts: list[float], tpots: list[float],
                   note: str = "") -> Result:
    """Throughput over the whole run plus the mean and median of per-request TTFTs and TPOTs (seconds)."""
    ttft, tpot = summary(ttfts), summary(tpots)
    return Result(seconds=seconds, output_tokens=output_tokens, ttft_mean=ttft["mean"], ttft_p50=ttft["p50"],
                  tpot_mean=tpot["mean"], tpot_p50=tpot["p50"], note=note)


def summarize(seconds: float, timings: list[RequestTiming], note: str = "") -> Result:
    """`from_latencies` of requests timed token by token."""
    return from_latencies(seconds, sum(len(t.token_times) for t in timings),
                          [t.ttft for t in timings if t.token_times],
                          [p for p in (t.tpot for t in timings) if p is not None], note)
