"""The machine's matrix-product ceiling for a model, so each system's tok/s reads as a fraction of it.

Every token's forward is, to first order, its linear layers: 2 FLOP per weight, so SmolLM2-135M
costs about 0.27 GFLOP per generated token (lm_head included) and 0.21 GFLOP per prompt token
(no lm_head: only the last prompt position is sampled). Attention's own products (QK^T, PV) add
a few percent at these lengths and are left out, so the roofline is slightly optimistic.

The peak is measured, not taken from a datasheet: the model's own linear shapes, every layer's
weights distinct (as in a real forward, so weights stream from memory instead of sitting in
cache), in the given dtype, on all of torch's threads. At M=1 (batch 1 decode) a product is
bound by how fast the weights stream from memory, which is why that rate is reported apart.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass

import torch

from gpu_worker.model_config import ModelConfig

CPU_FLAGS_OF_INTEREST = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, object]:
    """lscpu's model name and whether the flags that decide bf16 speed are present."""
    name = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"model_name": name, "cores": os.cpu_count() or 1,
            "flags": {flag: flag in flags for flag in CPU_FLAGS_OF_INTEREST}}


def cpu_line(cpu: dict[str, object] | None = None) -> str:
    """`cpu: NAME, N cores; FLAG yes|no, ...` for `cpu_description()`: the line every CPU benchmark prints first."""
    cpu = cpu or cpu_description()
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in cpu["flags"].items())  # type: ignore[attr-defined]
    return f"cpu: {cpu['model_name']}, {cpu['cores']} cores; {flags}"


def linear_shapes(mc: ModelConfig) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of one decoder layer's projections, and of lm_head."""
    h, hd = mc.hidden_size, mc.head_dim
    q, kv = mc.num_attention_heads * hd, mc.num_key_value_heads * hd
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, mc.intermediate_size), (h, mc.intermediate_size),
             (mc.intermediate_size, h)]
    return layer, (h, mc.vocab_size)


def flop_per_token(mc: ModelConfig) -> tuple[float, float]:
    """(FLOP per generated token, FLOP per prompt token): 2 per weight of the linear layers."""
    layer, head = linear_shapes(mc)
    body = 2.0 * mc.num_hidden_layers * sum(i * o for i, o in layer)
    return body + 2.0 * head[0] * head[1], body


def workload_flop(mc: ModelConfig, prompt_tokens: int, output_tokens: int) -> float:
    per_generated, per_prompt = flop_per_token(mc)
    return output_tokens * per_generated + prompt_tokens * per_prompt


@dataclass
class MatmulRates:
    dtype: str
    threads: int
    gflops_by_m: dict[int, float]  # rows per product (tokens in a step) -> GFLOP/s

    @property
    def peak(self) -> float:
        return max(self.gflops_by_m.values())

    @property
    def at_batch_1(self) -> float:
        return self.gflops_by_m.get(1, self.peak)


def measure_matmul_rates(mc: ModelConfig, dtype: torch.dtype, ms: tuple[int, ...] = (1, 64, 256, 1024),
                         min_seconds: float = 0.4, threads: int | None = None) -> MatmulRates:
    """GFLOP/s of one model-forward's worth of linear products for each row count M."""
    threads = threads or os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    layer, head = linear_shapes(mc)
    gen = torch.Generator().manual_seed(0)
    # Weights as nn.Linear keeps them, (out, in), and products through F.linear as the model does.
    weights = [[torch.randn(o, i, generator=gen).to(dtype) for i, o in layer] for _ in range(mc.num_hidden_layers)]
    head_w = torch.randn(head[1], head[0], generator=gen).to(dtype)
    flop_per_row = 2.0 * (mc.num_hidden_layers * sum(i * o for i, o in layer) + head[0] * head[1])
    rates: dict[int, float] = {}
    try:
        with torch.inference_mode():
            for m in ms:
                inputs = {i: torch.randn(m, i, generator=gen).to(dtype) for i, _ in layer + [head]}

                def forward() -> None:
                    for layer_weights in weights:
                        for w in layer_weights:
                            torch.nn.functional.linear(inputs[w.shape[1]], w)
                    torch.nn.functional.linear(inputs[head[0]], head_w)

                forward()  # warm-up: oneDNN picks and caches its kernels on first use
                best, spent = float("inf"), 0.0
                while spent < min_seconds:
                    start = time.perf_counter()
                    forward()
                    elapsed = time.perf_counter() - start
                    best, spent = min(best, elapsed), spent + elapsed
                rates[m] = m * flop_per_row / best / 1e9
    finally:
        torch.set_num_threads(previous)
    return MatmulRates(str(dtype).removeprefix("torch."), threads, rates)
