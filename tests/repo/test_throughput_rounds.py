"""benchmarks/throughput.py --rounds: each system's median round, and the stack's ratios per round; the
workload's latency summary, the same as `hetero-infer bench`'s."""

from __future__ import annotations

import pytest

from benchmarks.throughput import ENGINE, STACK, STACK_UNARY, median_results, round_ratios
from benchmarks.workload import Result


def tok_s(value: float) -> Result:
    return Result(seconds=1.0, output_tokens=int(value))


def test_median_round_per_mode() -> None:
    rounds = [{"batch": tok_s(300), "single": tok_s(30)}, {"batch": tok_s(100), "single": tok_s(50)},
              {"batch": tok_s(200), "single": tok_s(40)}]
    chosen = median_results(rounds)
    assert chosen["batch"].tok_per_s == 200 and chosen["single"].tok_per_s == 40
    # An even count takes the lower of the middle two; a mode no round has is left out.
    assert median_results([{"batch": tok_s(100)}, {"batch": tok_s(300)}]) == {"batch": tok_s(100)}


def test_ratios_per_round_against_that_rounds_best_vllm() -> None:
    rounds = [
        {STACK: {"batch": tok_s(360)}, STACK_UNARY: {"batch": tok_s(400)}, ENGINE: {"batch": tok_s(400)},
         "vLLM CPU float32": {"batch": tok_s(160)}, "vLLM CPU bfloat16": {"batch": tok_s(320)}},
        {STACK: {"batch": tok_s(380)}, ENGINE: {"batch": tok_s(400)}},  # vLLM failed in this round
    ]
    ratios = round_ratios("batch", rounds)
    assert ratios["stack / engine"] == pytest.approx([0.9, 0.95])
    assert ratios["stack / best vLLM"] == pytest.approx([360 / 320])
    assert ratios["stack, unary / engine"] == pytest.approx([1.0])
    assert round_ratios("single", rounds) == {}


def test_workload_and_hetero_infer_bench_agree_on_percentiles() -> None:
    """benchmarks/ and `hetero-infer bench` sum up the same latencies the same way (hetero_infer/bench/stats.py)."""
    from benchmarks.workload import RequestTiming, summarize
    from hetero_infer.bench.report import _summary

    timings = [RequestTiming([ttft, ttft + 0.1 * (i + 1)]) for i, ttft in enumerate((0.4, 0.1, 0.3, 0.2))]
    result = summarize(2.0, timings)
    bench_ms = _summary([t.ttft for t in timings])
    assert result.ttft_p50 == pytest.approx(0.25) and bench_ms["p50"] == pytest.approx(250.0)
    assert result.tpot_p50 == pytest.approx(0.25) and result.output_tokens == 8
