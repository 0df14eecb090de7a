"""hetero_infer/bench/stats.py: the percentile that `hetero-infer bench` and benchmarks/ share."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hetero_infer.bench.stats import percentile, summary, time_per_output_token


def test_interpolates_between_the_nearest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # an even count: the mean of the middle two
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([0.0, 100.0], 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([5.0, 1.0, 3.0], 0) == 1.0 and percentile([5.0, 1.0, 3.0], 100) == 5.0


def test_equals_numpy_default_to_the_bit() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 7, 10, 31, 64, 100, 257):
        values = [rng.lognormvariate(-3, 1) for _ in range(n)]
        for q in (0, 1, 25, 33.3, 50, 66.7, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == float(np.percentile(values, q)), (n, q)


def test_refuses_no_values_and_a_percentile_outside_0_to_100() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_of_values_and_of_none() -> None:
    assert summary([1.0, 2.0, 3.0, 4.0]) == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7),
                                             "p99": pytest.approx(3.97)}
    assert summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_time_per_output_token_counts_the_gaps_after_the_first_token() -> None:
    assert time_per_output_token(0.5, 2.5, 5) == 0.5
    assert time_per_output_token(0.5, 0.5, 1) is None
    assert time_per_output_token(0.5, 0.5, 0) is None
