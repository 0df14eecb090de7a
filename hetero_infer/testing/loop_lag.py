"""The gateway's event-loop lag from outside: its `hetero_gateway_event_loop_lag_seconds`
histogram scraped before and after something, and the largest lag observed in between."""

from __future__ import annotations

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
