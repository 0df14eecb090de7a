"""CPU worker start-up choices: the dtype behind `dtype: auto` and the torch thread count.

`auto` on a CPU runs bfloat16 only where bfloat16 matrix products are clearly faster than
float32: AMX (`amx_bf16`) always is, and so is AVX512-BF16 where the C linear kernel runs
(kernels/native/linear.py); elsewhere a ~0.1 s measurement of a matrix product of the model's
own width decides (plain AVX2 CPUs are slower in bfloat16). A measurement is only the fallback:
on a busy 2-core box it swung from 2.2x to under 1.5x between runs. The choice and its reason
are logged. float32 is the exact mode the oracle tests pin.

Threads: `num_threads: 0` shares the host's cores among every worker process on it
(data-parallel replicas × tensor-parallel ranks), so two replicas on a 2-core box take one
core each instead of both fighting for both; under `serve`, less the `reserved_cpus` it keeps
for the gateway and the scheduler (hetero_common/host_cores.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from gpu_worker.cpu.packed_linear import linear, pack_weight, prepack_supported
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_common.config import Config
from hetero_common.device_defaults import kv_blocks_cap
from hetero_common.host_cores import host_cores
from kernels.attention_backend import AttentionBackend, create_attention_backend
from kernels.cache_ops import allocate_kv_cache
from kernels.native import decode_attention as native_decode
from kernels.native import linear as native_linear

log = structlog.get_logger("gpu_worker.cpu.worker_setup")

# bfloat16 must beat float32 by this factor: the element-wise passes gain little or lose
# (no native bf16 arithmetic), so a marginal matmul win does not pay for them.
BF16_MIN_SPEEDUP = 1.5


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _matmul_seconds(dtype: torch.dtype, rows: int, width: int, out: int, prepack: bool, repeats: int = 6) -> float:
    """Best-of time of one [rows, width] x [out, width]^T product (after a warm-up), with the
    weight in the form the model will hold it (`prepack`: oneDNN's blocked layout)."""
    a = torch.randn(rows, width).to(dtype)
    b = torch.randn(out, width).to(dtype)
    if prepack and prepack_supported(torch.device("cpu"), dtype):
        b = pack_weight(b)
    linear(a, b)  # first call: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        linear(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bf16_speedup(width: int, prepack: bool = True, rows: int = 128) -> float:
    """float32 time / bfloat16 time of a product shaped like the model's MLP (width -> 4*width)."""
    width = max(64, min(width, 4096))
    out = 4 * width
    return (_matmul_seconds(torch.float32, rows, width, out, prepack)
            / _matmul_seconds(torch.bfloat16, rows, width, out, prepack))


def resolve_cpu_dtype(name: str, hidden_size: int, prepack: bool = True,
                      cpu_kernels: str = "auto") -> tuple[torch.dtype, str]:
    """(dtype, why) for a CPU worker; `name` is the config's dtype, `prepack` the config's
    `weight_prepack` (it changes both dtypes' speed, float32's most), `cpu_kernels` the config's
    (whether the C linear kernel may run)."""
    if name != "auto":
        return getattr(torch, name), "configured"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return torch.bfloat16, "cpu has amx_bf16"
    if "avx512_bf16" not in flags and flags:
        return torch.float32, "cpu has neither amx_bf16 nor avx512_bf16"
    if prepack and cpu_kernels != "torch" and native_linear.unavailable_reason(flags) is None:
        return torch.bfloat16, "cpu has avx512_bf16: bfloat16 linear layers through the C kernel"
    speedup = measure_bf16_speedup(hidden_size, prepack)
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"bfloat16 matmul measured {speedup:.1f}x float32"
    return torch.float32, f"bfloat16 matmul measured only {speedup:.1f}x float32 (needs {BF16_MIN_SPEEDUP}x)"


def choose_cpu_dtype(config: Config, hidden_size: int, tp: TensorParallel, threads: int) -> torch.dtype:
    """The CPU worker's dtype (`resolve_cpu_dtype`), rank 0's on every rank, logged with the thread count."""
    dtype, why = tp.rank0_choice(resolve_cpu_dtype(config.dtype, hidden_size, config.weight_prepack,
                                                   config.cpu_kernels))  # type: ignore[misc]
    log.info("cpu dtype and threads", dtype=str(dtype).removeprefix("torch."), requested=config.dtype,
             reason=why, threads=threads, reserved_cpus=max(0, config.reserved_cpus),
             weight_prepack=config.weight_prepack)
    return dtype


def plan_c_linear(dtype: torch.dtype, prepack: bool, cpu_kernels: str, shapes: list[tuple[int, int]],
                  deterministic: bool = False) -> tuple[bool, bool, int | None]:
    """(linear layers through the C kernel, through its AMX tile kernel, the most rows a product takes it, None:
    every product). The C kernel takes packed bfloat16 weights where it builds, unless `cpu_kernels` is torch;
    `shapes`: the [out, in] shapes of the model's weights on this rank (native_linear.plan). `deterministic`:
    the C kernel takes every product (on AMX CPUs, oneDNN's above a few rows are faster but its blocking
    follows the row count, so a row's bits would depend on its batch)."""
    c_linear = prepack and dtype == torch.bfloat16 and cpu_kernels != "torch"
    if c_linear and (why_not := native_linear.unavailable_reason(cpu_flags())):
        c_linear = False
        log.info("linear layers through oneDNN, not the C kernel", reason=why_not)
    amx, max_rows = native_linear.plan(cpu_flags(), shapes) if c_linear else (False, None)
    if deterministic:
        max_rows = None
    if max_rows is not None:
        log.info("linear layers through a C kernel up to a few rows, oneDNN above (weights packed for both)",
                 kernel="AMX tiles" if amx else "AVX512-BF16 panels", max_rows=max_rows,
                 reason="the CPU has AMX, where oneDNN wins on larger products")
    return c_linear, amx, max_rows


def row_invariance_unavailable(head_dim: int, block_size: int) -> str | None:
    """Why bfloat16 rows are not bitwise path-invariant here (config `deterministic`), or None where the C
    kernels take every row: the C linear kernel every product, the C attention kernel's vector path every
    query row (head size 64 or 128, blocks of a multiple of 16 slots, AVX512-BF16)."""
    if why := native_linear.unavailable_reason(cpu_flags()):
        return why
    if not native_decode.takes_prompts(head_dim, block_size):
        return (f"the C attention kernel does not take prompt rows of head size {head_dim} in blocks of {block_size} "
                "here (its vector path: head size 64 or 128, blocks of a multiple of 16, AVX512-BF16)")
    return None


def allocate_cpu_kv_cache(config: Config, model, head_dim: int, kv_dtype: torch.dtype, bytes_per_block: int,
                          agree: Callable[[int], int] = lambda blocks: blocks) -> tuple[int, AttentionBackend, torch.Tensor]:
    """(blocks, the attention backend, a KV cache of `kv_cache_memory_gb`, at most `max_num_blocks` blocks or, unset,
    the seed's 1024) for the
    model's heads on this rank; `agree` turns this rank's count into the one every rank holds
    (TensorParallel.agreed_kv_blocks)."""
    cap = kv_blocks_cap(config, "cpu")
    num_blocks = agree(max(1, min(cap, int(config.kv_cache_memory_gb * 2**30 // bytes_per_block))))
    # AMX CPUs: prompt chunks attend apart (an AMX tile kernel; without it, fresh prompts through SDPA), unless
    # `deterministic` keeps every row on the C kernel (its per-row path and 16-row tiles: the same bits).
    attention = create_attention_backend(config.attention_backend, model.num_heads, model.num_kv_heads, head_dim,
                                         "cpu", model.dtype, decode_kernel=config.cpu_kernels,
                                         prompts_apart="amx_bf16" in cpu_flags() and not config.deterministic,
                                         kv_dtype=kv_dtype, scale=model.config.attention_scale)
    kv_cache = allocate_kv_cache(model.config.num_hidden_layers, num_blocks, config.block_size, model.num_kv_heads,
                                 head_dim, kv_dtype, "cpu", attention.kv_layout)
    return num_blocks, attention, kv_cache


def worker_threads(num_threads: int, data_parallel_size: int, tensor_parallel_size: int, reserved_cpus: int = 0) -> int:
    """Torch intra-op threads of one worker process: the configured count, or (0) this host's
    cores but `reserved_cpus` divided among all its workers (replicas × ranks), at least one.
    A negative `reserved_cpus` (auto, outside `serve`, which resolves it) reserves none."""
    if num_threads:
        return num_threads
    cores = host_cores() - max(0, reserved_cpus)
    return max(1, cores // max(1, data_parallel_size * tensor_parallel_size))


def configure_cpu_threads(num_threads: int, data_parallel_size: int, tensor_parallel_size: int,
                          reserved_cpus: int = 0) -> int:
    threads = worker_threads(num_threads, data_parallel_size, tensor_parallel_size, reserved_cpus)
    torch.set_num_threads(threads)
    return threads
