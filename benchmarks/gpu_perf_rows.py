"""benchmarks/gpu_bench.py's JSON as the Markdown rows of docs/perf/ and docs/gpu.md, each row with its machine,
date and commit, ready to paste (`bash scripts/gpu_run.sh first` writes them to perf_rows.md):

    python benchmarks/gpu_perf_rows.py gpu_bench.json --machine H200 --date 2026-12-01 --commit abc1234
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def decode_rows(results: dict, stamp: str) -> list[str]:
    """| batch | eager ms/step | graphs ms/step | graphs tok/s | GB read/step | roofline (graphs) | machine | date | commit |"""
    by = {(r["batch"], r["graphs"]): r for r in results["decode"]}
    lines = ["| batch | eager ms/step | graphs ms/step | graphs tok/s | GB read/step | roofline (graphs) "
             "| machine | date | commit |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in sorted({b for b, _ in by}):
        eager, graphs = by.get((batch, False)), by.get((batch, True))
        if eager is None or graphs is None:
            continue
        lines.append(f"| {batch} | {eager['step_ms']:.2f} | {graphs['step_ms']:.2f} | {graphs['tokens_per_s']:,.0f} "
                     f"| {graphs['bytes_per_step'] / 1e9:.2f} | {graphs['roofline_fraction']:.0%} | {stamp} |")
    return lines


def breakdown_rows(results: dict, stamp: str) -> list[str]:
    """A graph decode step's parts, per batch (`--breakdown`), in ms."""
    parts = results.get("graph_step_breakdown") or []
    if not parts:
        return []
    lines = ["| batch | step | replay (GPU) | run() on the host | plan() | read-back | GPU waits | machine | date | commit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in parts:
        lines.append(f"| {p['batch']} | {p['step_ms']:.2f} | {p['replay_ms']:.2f} | {p['run_host_ms']:.2f} "
                     f"| {p['plan_ms']:.2f} | {p['read_back_ms']:.2f} | {p['gpu_waits_ms']:.2f} | {stamp} |")
    return lines


def summary_lines(results: dict) -> list[str]:
    lines = [f"Device {results['device']}, torch {results['torch']}, flashinfer {results['flashinfer']}; "
             f"{results.get('elementwise', '?')} element-wise ops, {results.get('quantization', 'none')} weights, "
             f"{results.get('kv_cache_dtype', '?')} KV, {results['context']} cached tokens per sequence; "
             f"copy bandwidth {results['copy_bandwidth_gbs']:,.0f} GB/s."]
    if "ttft_ms" in results:
        lines.append(f"Time to first token: {results['ttft_ms']:.1f} ms; mixed step: {results['mixed_step_ms']:.2f} ms; "
                     f"decode attention FlashInfer {results['attention_us']['flashinfer']:.1f} µs against the torch "
                     f"reference's {results['attention_us']['torch']:.1f} µs.")
    for name, ok in results.get("targets", {}).items():
        lines.append(f"- [{'met' if ok else 'MISSED'}] {name}")
    return lines


def markdown(results: dict, machine: str, date: str, commit: str) -> str:
    stamp = f"{machine} | {date} | `{commit}`"
    blocks = [summary_lines(results), decode_rows(results, stamp), breakdown_rows(results, stamp)]
    return "\n\n".join("\n".join(b) for b in blocks if b) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path)
    parser.add_argument("--machine", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args(argv)
    sys.stdout.write(markdown(json.loads(args.json.read_text()), args.machine, args.date, args.commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
