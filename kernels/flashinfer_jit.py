"""The FlashInfer JIT modules a worker selects, named without a device, and building them.

FlashInfer 0.7.2.post1 ships no kernels: its wrappers' `plan()` compiles (nvcc + ninja) and
loads one module per kernel family on first use. This module names, for an attention shape,
the JIT specs `kernels/flashinfer_backend.py` makes FlashInfer pick, following the wrappers'
own choice:

- append: `append_paged_kv_cache` -> the `page` module;
- decode (eager and CUDA-graph, which select the same module): GQA group <= 4 -> the CUDA-core
  batch-decode module; larger groups -> tensor cores, which run FlashInfer's FA2 prefill module;
- prefill: FA3 on sm90 (what `determine_attention_backend` answers there for bf16/fp16 without
  FlashInfer's RoPE), FA2 elsewhere;
- the fused element-wise passes (kernels/flashinfer_fused.py, config `use_flashinfer_fused_rope`):
  the `norm`, `rope` and `silu_and_mul` modules, one each whatever the shape.

Two uses: `scripts/flashinfer_jit.py compile` builds each module's object files and stops
before the link (no libcuda without a driver), so a template or API mismatch fails CI on a
machine without a GPU; `scripts/flashinfer_jit.py build` compiles and loads them on the GPU
machine before tests, benchmark or serving (the JIT then costs nothing later).
`flashinfer` is imported only inside these functions.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.flashinfer_backend import decode_uses_tensor_cores


@dataclass(frozen=True)
class AttentionShape:
    """What decides the modules: heads (per rank), head size, the compute dtype and the cache's (None: the
    compute dtype; float8_e4m3fn: config `kv_cache_dtype: fp8`)."""

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None
    window: bool = False  # a sliding-window layer's modules (FlashInfer's window_left >= 0)


# The shapes checked without a device. The default model, SmolLM2-135M (9 query heads, 3 KV
# heads, head_dim 64: CUDA-core decode); the GPU tests' and benchmark's head_dim-64 Llamas (group
# 4); a head_dim-128 model with a GQA group of 4 (Llama-3-8B) and one of 7 (Qwen2.5-7B: tensor-core
# decode), as tests/gpu/test_gpu.py's attention test uses them.
CHECKED_SHAPES = (
    AttentionShape("SmolLM2-135M (default model)", 9, 3, 64),
    AttentionShape("Llama-3.2-1B shape (gpu_bench)", 32, 8, 64),
    AttentionShape("Llama-3-8B shape (head_dim 128)", 32, 8, 128),
    AttentionShape("Qwen2.5-7B shape (head_dim 128, group 7)", 28, 4, 128),
)
# What `scripts/flashinfer_jit.py build` prepares on the GPU machine: the checked shapes, and the fp8 caches of
# the GPU tests' and gpu_bench's head_dim-64 Llamas (group 4). Not in the compile check, which already takes
# most of CI's slow part: their names follow the same rule, and the GPU run builds them.
DEVICE_SHAPES = CHECKED_SHAPES + (
    AttentionShape("Llama-3.2-1B shape, fp8 KV (gpu_bench --kv-cache-dtype fp8)", 32, 8, 64,
                   kv_dtype=torch.float8_e4m3fn),
    # tests/gpu/test_gpu_gemma3.py's: head_dim 256, the global layers' modules and the window layers'
    AttentionShape("Gemma-3 shape (head_dim 256)", 4, 1, 256),
    AttentionShape("Gemma-3 shape, sliding window", 4, 1, 256, window=True),
)


def arch_from_env(default: str = "9.0a") -> tuple[int, int]:
    """The compute capability FLASHINFER_CUDA_ARCH_LIST names first ("9.0a" -> (9, 0))."""
    first = (os.environ.get("FLASHINFER_CUDA_ARCH_LIST") or default).replace(",", " ").split()[0]
    major, minor = first.rstrip("af").split(".")
    return int(major), int(minor)


def prefill_backend(shape: AttentionShape, capability: tuple[int, int]) -> str:
    """FA3 where FlashInfer's `determine_attention_backend` picks it for our plan arguments
    (no custom mask, pos_encoding_mode NONE, no fp16 QK reduction, q and KV of one 16-bit
    dtype), else FA2. Mirrored rather than called: that function asks a CUDA device."""
    from flashinfer.utils import is_fa3_prefill_head_dim_supported

    if shape.kv_dtype not in (None, shape.dtype):  # FA3 takes q and KV of one 16-bit dtype
        return "fa2"
    if capability[0] == 9 and is_fa3_prefill_head_dim_supported(shape.head_dim, shape.head_dim):
        return "fa3"
    return "fa2"


def module_specs(shape: AttentionShape, capability: tuple[int, int]) -> dict[str, Any]:
    """Role -> the JitSpec FlashInfer builds for it ("append", "decode", "graph decode", "prefill")."""
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_primary_module,  # what get_batch_prefill_module builds for fa2
        gen_batch_decode_module,
        gen_batch_prefill_module,
    )
    from flashinfer.jit.page import gen_page_module

    d, hd = shape.dtype, shape.head_dim
    # (q, kv, out, index dtype, head_dim qk, head_dim vo, pos_encoding NONE, a sliding window or none, no soft cap)
    common = (d, shape.kv_dtype or d, d, torch.int32, hd, hd, 0, shape.window, False)

    def prefill(backend: str) -> Any:
        if backend == "fa3":
            return gen_batch_prefill_module("fa3", *common, False)
        return _gen_batch_prefill_primary_module("fa2", *common, False)

    if decode_uses_tensor_cores(shape.num_qo_heads, shape.num_kv_heads):
        decode = prefill("fa2")  # the tensor-core decode path: bf16/fp16 auto resolves to fa2
    else:
        decode = gen_batch_decode_module(*common)
    return {"append": gen_page_module(), "decode": decode, "graph decode": decode,
            "prefill": prefill(prefill_backend(shape, capability))}


def elementwise_specs() -> dict[str, Any]:
    """Role -> the JitSpec of the fused element-wise modules kernels/flashinfer_fused.py calls (every shape's)."""
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    return {"RMSNorm and its residual add": gen_norm_module(), "RoPE": gen_rope_module(),
            "SiLU·mul": gen_act_and_mul_module("silu")}


def unique_specs(shapes: tuple[AttentionShape, ...], capability: tuple[int, int]) -> list[tuple[str, Any]]:
    """(which shapes and roles use it, spec) once per distinct module, in first-use order: the attention modules
    of each shape, then the fused element-wise ones."""
    users: dict[str, list[str]] = {}
    specs: dict[str, Any] = {}
    for shape in shapes:
        for role, spec in module_specs(shape, capability).items():
            specs.setdefault(spec.name, spec)
            users.setdefault(spec.name, []).append(f"{shape.name}: {role}")
    for role, spec in elementwise_specs().items():
        specs.setdefault(spec.name, spec)
        users.setdefault(spec.name, []).append(f"every shape: {role}")
    return [("; ".join(users[name]), spec) for name, spec in specs.items()]


def compile_inputs_digest(specs: list[tuple[str, Any]], toolchain: str) -> str:
    """A sha256 over what decides the compile check's outcome: each selected module's name (the kernels chosen),
    its sources' contents (FlashInfer's generated ones included) and flags, FlashInfer's version and target
    architecture, and `toolchain` (the caller's: nvcc's release, whose CUDA headers come with it, and the pins
    of the library headers' wheels). Paths are left out: the same inputs give the same digest in any checkout."""
    import hashlib

    import flashinfer

    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            digest.update(repr(part).encode() + b"\0")

    add(flashinfer.__version__, os.environ.get("FLASHINFER_CUDA_ARCH_LIST"), toolchain)
    for _, spec in sorted(specs, key=lambda item: item[1].name):
        add(spec.name, spec.extra_cflags, spec.extra_cuda_cflags, spec.extra_ldflags, spec.needs_device_linking)
        for source in sorted(spec.sources, key=lambda p: Path(p).name):
            add(Path(source).name, hashlib.sha256(Path(source).read_bytes()).hexdigest())
    return digest.hexdigest()


def object_targets(ninja_file: Path) -> list[Path]:
    """The outputs of a FlashInfer ninja file's compile steps: every `build OUT: compile|cuda_compile
    SRC` line. Read from the file, not from `JitSpec.get_object_paths()`, which 0.7.2.post1's
    generator no longer matches (it prefixes object names with their source folder)."""
    targets = []
    for line in ninja_file.read_text().splitlines():
        if line.startswith("build ") and ":" in line:
            output, rule = line[len("build "):].split(":", 1)
            if rule.split()[0] in ("compile", "cuda_compile"):
                targets.append(Path(output.strip().replace("$ ", " ")))
    return targets


def run_ninja(spec: Any, jobs: int | None, targets: list[str], doing: str) -> None:
    """The module's own ninja file, for `targets` (none: its default, the shared library); raises with the
    output's tail when it fails."""
    command = ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)]
    if jobs:
        command += ["-j", str(jobs)]
    done = subprocess.run(command + targets, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{doing} {spec.name} failed:\n{done.stdout[-8000:]}")


def compile_objects(spec: Any, jobs: int | None = None) -> list[Path]:
    """Compile a module's sources to object files with its own ninja file, without the link."""
    spec.write_ninja()
    objects = object_targets(spec.ninja_path)
    if not objects:
        raise RuntimeError(f"{spec.ninja_path} names no compile step")
    run_ninja(spec, jobs, [str(p) for p in objects], "compiling")
    missing = [p for p in objects if not p.exists()]
    if missing:
        raise RuntimeError(f"{spec.name}: ninja succeeded but left out {missing}")
    return objects


def link_module(spec: Any, jobs: int | None = None) -> Path:
    """Compile and link a module to its shared library without loading it; its path. The link takes
    `-lcuda` from `$CUDA_HOME/lib64/stubs` or FLASHINFER_EXTRA_LDFLAGS (a driver's library, or the stub
    `libcuda_stub` makes): the library only has to name `libcuda.so.1`, which the GPU machine's driver serves."""
    spec.write_ninja()
    run_ninja(spec, jobs, [], "building")
    if not spec.jit_library_path.exists():
        raise RuntimeError(f"{spec.name}: ninja succeeded but left no {spec.jit_library_path}")
    return spec.jit_library_path


def libcuda_stub(folder: Path) -> Path:
    """An empty `libcuda.so` whose soname is `libcuda.so.1`, for linking FlashInfer's modules on a machine
    without a driver: a shared library may leave the driver's symbols undefined, and at load time on the GPU
    machine `libcuda.so.1` (the driver's) defines them."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "libcuda.so"
    if not stub.exists():
        source = folder / "libcuda_stub.c"
        source.write_text("/* no symbols: the driver's libcuda.so.1 defines them at load time */\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(source)],
                       check=True)
    return stub


def build_and_load(spec: Any) -> float:
    """Compile, link and load a module as first use would (needs the driver); seconds taken."""
    started = time.perf_counter()
    spec.build_and_load()
    return time.perf_counter() - started


def modules_built_by_steps(shape: AttentionShape) -> tuple[set[str], set[str]]:
    """On a GPU: (modules FlashInfer builds for a prefill, an eager decode and a graph-mode decode
    step of `shape`, with the fused element-wise passes of a layer (kernels/flashinfer_fused.py), modules
    `module_specs` and `elementwise_specs` name for them). Run it in a fresh interpreter: FlashInfer caches
    loaded modules per process, and a module loaded before is not built again."""
    import numpy as np
    from flashinfer.jit.core import JitSpecNvcc

    from kernels import flashinfer_fused
    from kernels.cache_ops import allocate_kv_cache
    from kernels.flashinfer_backend import FlashInferGraphDecode, FlashInferPagedAttention
    from kernels.page_table import PageTable

    built: set[str] = set()
    original = JitSpecNvcc.build_and_load

    def recording(spec: JitSpecNvcc) -> Any:
        built.add(spec.name)
        return original(spec)

    JitSpecNvcc.build_and_load = recording  # type: ignore[method-assign]
    try:
        cuda, dtype, hq, hkv, d, page = torch.device("cuda"), shape.dtype, shape.num_qo_heads, shape.num_kv_heads, \
            shape.head_dim, 16
        cache = allocate_kv_cache(1, 8, page, hkv, d, dtype, cuda)[0]
        eager = FlashInferPagedAttention(hq, hkv, d, cuda, dtype=dtype)
        graph = FlashInferGraphDecode(2, torch.zeros(8, dtype=torch.int32, device=cuda), hq, hkv, d, cuda, dtype,
                                      eager.workspace)
        pages = [np.array([0, 1], dtype=np.int32), np.array([2], dtype=np.int32)]
        for attention, qo in ((eager, [20, 3]), (eager, [1, 1]), (graph, [1, 1])):
            table = PageTable.build(pages, np.array(qo), np.array([20, 3]), page)
            _, slots = table.token_positions()
            new = [torch.randn(table.num_tokens, h, d, dtype=dtype, device=cuda) for h in (hkv, hkv, hq)]
            attention.plan(table)
            attention.write_kv(cache, new[0], new[1], torch.from_numpy(slots).to(cuda))
            attention.run(new[2], cache)
        # A layer's element-wise passes around attention: RMSNorm with and without the residual, RoPE, SiLU·mul
        rows = torch.randn(3, 2 * hq * d, dtype=dtype, device=cuda)
        weight = torch.ones(2 * hq * d, dtype=dtype, device=cuda)
        flashinfer_fused.add_rms_norm(rows, flashinfer_fused.add_rms_norm(rows, None, weight, 1e-5), weight, 1e-5)
        qkv = torch.randn(3, (hq + 2 * hkv) * d, dtype=dtype, device=cuda)
        table = flashinfer_fused.cos_sin_cache(torch.rand(8, d // 2, device=cuda), torch.rand(8, d // 2, device=cuda))
        flashinfer_fused.rope_(qkv, hq, hkv, d, torch.arange(3, device=cuda), table)
        flashinfer_fused.silu_mul(rows)
        torch.cuda.synchronize()
    finally:
        JitSpecNvcc.build_and_load = original  # type: ignore[method-assign]
    named = {spec.name for spec in module_specs(shape, torch.cuda.get_device_capability()).values()}
    return built, named | {spec.name for spec in elementwise_specs().values()}
