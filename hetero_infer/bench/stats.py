"""Latency statistics, one definition for `hetero-infer bench` and the scripts in benchmarks/.

Percentiles interpolate linearly between the two nearest ranks: numpy's default method ("linear",
Hyndman and Fan's type 7), which is also how vLLM's serving benchmark computes its TTFT/TPOT/ITL
percentiles, so figures from either tool compare with vLLM's. It is defined for any number of values,
and its p50 is the ordinary median (the mean of the middle two of an even count). Computed here in
plain Python, to the bit as `numpy.percentile` does (tests/unit/hetero_infer/test_bench_stats.py), so
that callers need no numpy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

SUMMARY_PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, interpolated between the nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * (q / 100)
    if position >= len(ordered) - 1:
        return ordered[-1]
    below = math.floor(position)
    low, high = ordered[below], ordered[below + 1]
    fraction = position - below
    # numpy's interpolation, from whichever end is nearer: the same float, last bit included.
    if fraction >= 0.5:
        return high - (high - low) * (1 - fraction)
    return low + (high - low) * fraction


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and the p50 / p90 / p99 of `values` (all None when there are none), in their own unit."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in SUMMARY_PERCENTILES}}
    return {"mean": statistics.fmean(values), **{f"p{q}": percentile(values, q) for q in SUMMARY_PERCENTILES}}


def time_per_output_token(first_token_at: float, last_at: float, output_tokens: int) -> float | None:
    """TPOT as vLLM defines it: the time after the first token over the tokens after it (None below 2
    tokens). Each caller says what `last_at` is: the last token's time, or the end of the response."""
    if output_tokens < 2:
        return None
    return (last_at - first_token_at) / (output_tokens - 1)
