"""No test compares a measured time or memory reading with a threshold (issue 56): on a shared
2-core machine such an assertion fails by turns (0.598 s against `< 0.5`, 60 MiB against 50).
A test asserts the mechanism instead: what was called, on which thread, what was read or freed,
in what order; a hang is caught by a deadline or a timeout on the blocking call. The rule, read
from the source with `ast`, is tests/helpers/timing_asserts.py's."""

from __future__ import annotations

import textwrap

import pytest

from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.timing_asserts import thresholds_in_files, thresholds_in_source

# Helpers outside tests/ that the tests call (their results are measured when they return a measure), not
# checked themselves.
HELPER_MODULES = (REPO_ROOT / "hetero_infer" / "bench" / "harness.py",)


def test_no_test_compares_a_time_or_memory_reading_with_a_threshold() -> None:
    found = thresholds_in_files((REPO_ROOT / "tests").rglob("*.py"), HELPER_MODULES)
    if found:
        pytest.fail("assertions of a time or memory reading against a threshold (assert the mechanism instead):\n"
                    + "\n".join(finding.describe(REPO_ROOT) for finding in found))


# --- the checker itself, on planted sources ---


def flagged(source: str) -> list[int]:
    """The lines of `source` whose assertion the checker flags."""
    return [finding.line for finding in thresholds_in_source(textwrap.dedent(source))]


@pytest.mark.parametrize("source", [
    """
    import time
    def test_refused_at_once():
        t0 = time.perf_counter()
        refuse()
        assert time.perf_counter() - t0 < 0.5
    """,
    """
    import time
    def test_answered():
        t0 = time.monotonic()
        send()
        elapsed = time.monotonic() - t0
        assert elapsed < 0.25
    """,
    """
    import psutil
    LIMIT = 50 * 2**20
    def test_memory_comes_back():
        before = psutil.Process().memory_info().rss
        work()
        grown = psutil.Process().memory_info().rss - before
        assert grown < LIMIT
    """,
    """
    import resource
    def test_peak():
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss <= 200_000
    """,
    """
    import time
    def test_pings_stay_fast():
        latencies = []
        def ping():  # fills its parent's list, on another thread
            start = time.perf_counter()
            get()
            latencies.append(time.perf_counter() - start)
        run(ping)
        assert len(latencies) >= 3 and max(latencies) < 0.25
    """,
    """
    import time
    def timed(action):
        start = time.perf_counter()
        return action(), time.perf_counter() - start
    def test_through_a_helper():
        answer, seconds = timed(send)
        assert seconds < 1.0
    """,
    """
    import asyncio, time
    def test_median_of_five():
        async def main():
            seconds = []
            for _ in range(5):
                start = time.perf_counter()
                await call()
                seconds.append(time.perf_counter() - start)
            return sorted(seconds)
        seconds = asyncio.run(main())
        assert seconds[2] < 0.08
    """,
    """
    TIMEOUT_S = 1.5
    def test_a_window():
        start = clock.monotonic()
        wait_closed()
        assert TIMEOUT_S - 0.1 < clock.monotonic() - start < TIMEOUT_S + 1.5
    """,
    """
    def test_every_answer_within_a_second(attack):
        slow = [case for case, seconds in attack.answers if seconds >= 1.0]
        assert not slow, slow
    """,
    """
    def p99(gaps):
        return sorted(gaps)[int(len(gaps) * 0.99)]
    def test_relative(attack):
        baseline, hostile = attack.gaps("baseline"), attack.gaps("hostile")
        assert p99(hostile) <= 2 * p99(baseline)
    """,
    """
    def test_a_drop_of_at_least_three_quarters(follower):
        block_bytes, num_blocks = 4096, 32768
        before = follower.memory_info().rss
        suspend()
        drop = before - follower.memory_info().rss
        assert drop > 0.75 * num_blocks * block_bytes
    """,
])
def test_the_checker_flags_a_planted_threshold(source: str) -> None:
    lines = textwrap.dedent(source).rstrip().splitlines()
    assert flagged(source) == [len(lines)], lines[-1]  # the last line: the assertion


@pytest.mark.parametrize("source", [
    """
    import time
    def test_mechanism(stack):
        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() < deadline, "not ready"  # a deadline, not a threshold
        answer, statuses = while_asking(stack, send)
        assert answer.count > 100_000 and len(statuses) >= 3 and set(statuses) == {200}
    """,
    """
    import time
    def test_timed_but_not_compared():
        start = time.perf_counter()
        result = work()
        print(f"took {time.perf_counter() - start:.2f} s")
        assert result == 42 and len(result.tokens) <= 512
    """,
    """
    def test_config(config):
        assert config.startup_timeout_s >= 600 and config.max_model_len > 0
    """,
    """
    def test_sizes(cut, whole):
        assert cut.stat().st_size < whole.stat().st_size // 20
    """,
])
def test_the_checker_passes_an_ordinary_assertion(source: str) -> None:
    assert flagged(source) == []
