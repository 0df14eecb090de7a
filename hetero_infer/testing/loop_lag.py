"""The gateway's event-loop lag from outside: its `hetero_gateway_event_loop_lag_seconds`
histogram scraped before and after something, and the largest lag observed in between."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx

_PREFIX = 'hetero_gateway_event_loop_lag_seconds_bucket{le="'


def loop_lag_buckets(url: str, headers: dict[str, str] | None = None) -> dict[float, float]:
    """The gateway's event-loop lag histogram: observations at or under each bound (empty before the metric)."""
    return {float(line[len(_PREFIX):].split('"')[0]): float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics", headers=headers, timeout=10).text.splitlines()
            if line.startswith(_PREFIX)}


def lag_bound(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound that holds every lag observed between the two scrapes."""
    if not after:
        return None
    total = after[float("inf")] - before.get(float("inf"), 0)
    return min(le for le in after if after[le] - before.get(le, 0) >= total)


def while_pinging(url: str, action: Callable[[], Any], settle_s: float = 0.2,
                  after_s: float = 0.1) -> tuple[Any, float, list[float]]:
    """action()'s result and seconds, and the latencies of GET /v1/models sent every 10 ms meanwhile
    (from `settle_s` before it to `after_s` after it)."""
    latencies: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                assert client.get(f"{url}/v1/models").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(settle_s)
    try:
        start = time.perf_counter()
        result = action()
        seconds = time.perf_counter() - start
        time.sleep(after_s)
    finally:
        stop.set()
        pinger.join()
    return result, seconds, latencies
