"""One hostile prompt against a real `hetero-infer serve`: how long the gateway's event loop stalls
and how much memory it keeps.

While a prompt of `--mib` MiB of short words is sent to /v1/completions (it cannot fit the context,
so the answer is a 400), a second client asks GET /v1/models every 10 ms: its slowest answer bounds
the event loop's stall from outside. Reports that, the hostile request's status and time, the
gateway's RSS before and a few seconds after, and the gateway's own
`hetero_gateway_event_loop_lag_seconds` where it has it (the histogram bucket that holds the
largest lag during the attack).

    python -m benchmarks.hostile_prompt --mib 18 4            # the default model (SmolLM2-135M)
    python -m benchmarks.hostile_prompt --model DIR --mib 4
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import httpx

from hetero_infer.bench.harness import lag_bound, loop_lag_buckets, run_stack, while_pinging

WORDS = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike"]


def hostile_text(mib: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(int(mib * 2**20 / 5.5))]
    return " ".join(words)


def attack(url: str, text: str, rss: "callable[[], int]") -> dict[str, float | int | None]:
    """Send one hostile prompt while pinging; the figures."""
    before, lags = rss(), loop_lag_buckets(url)
    body = {"prompt": text, "max_tokens": 1}
    answer, seconds, latencies = while_pinging(
        url, lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=300), settle_s=0.3, after_s=0.5)
    time.sleep(2.0)
    return {"status": answer.status_code, "seconds": round(seconds, 3), "pings": len(latencies),
            "ping_max_s": round(max(latencies), 4), "rss_before_mib": before >> 20, "rss_after_mib": rss() >> 20,
            "loop_lag_at_most_s": lag_bound(lags, loop_lag_buckets(url))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--mib", type=float, nargs="+", default=[18.0, 4.0])
    args = parser.parse_args()
    texts = {mib: hostile_text(mib) for mib in args.mib}
    with run_stack(args.model) as stack:
        gateway = stack.service_process("gateway")
        httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        for mib, text in texts.items():
            figures = attack(stack.http_url, text, lambda: gateway.memory_info().rss)
            print(f"{mib:g} MiB ({len(text)} chars): {figures}", flush=True)


if __name__ == "__main__":
    main()
