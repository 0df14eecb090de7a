"""Benchmark figures: latency percentiles and throughput; printed as a table, saved as JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hetero_infer.bench.clients import RequestRecord
from hetero_infer.bench.stats import summary


def _summary(values: list[float]) -> dict[str, float | None]:
    return summary([v * 1000.0 for v in values])  # milliseconds


def summarize(records: list[RequestRecord], duration_s: float, settings: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "settings": settings,
        "duration_s": duration_s,
        "requests": {"completed": len(ok), "failed": len(records) - len(ok),
                     "errors": sorted({r.error for r in records if r.error})[:10]},
        "tokens": {"prompt": prompt_tokens, "output": output_tokens},
        "throughput": {"requests_per_s": len(ok) / duration_s if duration_s else 0.0,
                       "output_tokens_per_s": output_tokens / duration_s if duration_s else 0.0,
                       "total_tokens_per_s": (prompt_tokens + output_tokens) / duration_s if duration_s else 0.0},
        "latency_ms": {"ttft": _summary([r.ttft for r in ok]), "tpot": _summary([t for r in ok if (t := r.tpot) is not None]),
                       "itl": _summary([x for r in ok for x in r.itls]), "e2e": _summary([r.e2e for r in ok])},
        "per_request": [{"start_s": r.start, "ttft_s": r.ttft if r.ok else None, "e2e_s": r.e2e, "prompt_tokens": r.prompt_tokens,
                         "output_tokens": r.output_tokens, "error": r.error or None} for r in records],
    }


def table(result: dict[str, Any]) -> str:
    req, tp, lat = result["requests"], result["throughput"], result["latency_ms"]
    fmt = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
    lines = [
        f"requests: {req['completed']} completed, {req['failed']} failed in {result['duration_s']:.1f} s",
        f"throughput: {tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} output tok/s, "
        f"{tp['total_tokens_per_s']:.1f} total tok/s",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = lat[name]
        lines.append(f"{name.upper():<12}" + "".join(f"{fmt(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    for error in req["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))


def plot(records: list[RequestRecord], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (title, values) in zip(axes.flat, (("TTFT", [r.ttft for r in ok]),
                                               ("TPOT", [t for r in ok if (t := r.tpot) is not None]),
                                               ("end-to-end latency", [r.e2e for r in ok]))):
        ax.hist(np.asarray(values) * 1000.0, bins=30, color="tab:blue", alpha=0.8)
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
    ax = axes.flat[3]
    times = np.asarray([t for r in ok for t in r.chunk_times])
    if times.size:
        # Bins of at least a second and ~50 over the run: a slow engine step must not alias into spikes.
        width = max(1.0, float(times.max()) / 50)
        edges = np.arange(0.0, float(times.max()) + width, width)
        counts, _ = np.histogram(times, bins=edges)
        ax.plot(edges[:-1], counts / width, drawstyle="steps-post", color="tab:green", label="streamed chunks/s")
        done = np.asarray(sorted(r.end for r in ok))
        ax2 = ax.twinx()
        ax2.plot(done, np.arange(1, done.size + 1), color="tab:orange", label="requests completed")
        ax2.set_ylabel("requests completed")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("chunks (~tokens) per second")
    s = result["settings"]
    fig.suptitle(f"hetero-infer bench: {s.get('protocol')} {s.get('target')}, {len(ok)} requests, "
                 f"rate {s.get('request_rate')}, concurrency {s.get('max_concurrency')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
