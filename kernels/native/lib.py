"""The CPU C kernels of kernels/native/ (the .c and .h files beside this module), built into one
library on first use and loaded with ctypes.

Built with the host's C compiler (`cc`, or `$CC`) into a per-user cache (`$HETERO_CACHE_DIR`,
else `$XDG_CACHE_HOME` or `~/.cache`, then `hetero-infer/native/`) keyed by the sources, the
flags, the compiler and the CPU's flags (`-march=native`), in about a second: no torch headers.
Where it cannot be built (no compiler, a failed build) callers fall back to their torch code and
the reason is logged once. OpenMP: the library is loaded after torch, so its libgomp.so.1
dependency resolves to the copy torch already loaded: the same threads, the same thread count
(`torch.set_num_threads`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch  # noqa: F401  (loaded first: see the module doc)

log = structlog.get_logger("kernels.native.lib")

NATIVE_DIR = Path(__file__).resolve().parent  # the C sources sit beside this module
SOURCES = sorted(NATIVE_DIR.glob("*.c"))
HEADERS = sorted(NATIVE_DIR.glob("*.h"))
# -ffast-math for the compile only (the kernels' vectorized reductions, glibc's vector expf):
# linking a shared library with it (GCC < 13) adds crtfastmath.o, whose constructor sets
# flush-to-zero and denormals-are-zero for the whole process on load, changing every float
# operation of torch, numpy and Python code around it. So: compile, then link without it.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
# The attention kernels that share attention_order.h's arithmetic, the GGUF products' row tiles of 1-8
# rows, the LoRA deltas (lora.c), and the int8 KV quantizer (torch's float32 operations, bit for bit): the compiler may not reassociate their sums, approximate their divisions or fuse a product into a
# later addition, or two paths could round differently (a row's output would depend on which computed it).
STRICT_SOURCES = {"attention_rows_bf16.c", "prompt_row_tiles.c", "linear_gguf.c", "kv_formats.c", "lora.c"}
STRICT_FLAGS = ["-fno-associative-math", "-fno-reciprocal-math", "-ffp-contract=off"]


def compile_flags(source: Path) -> list[str]:
    return COMPILE_FLAGS + (STRICT_FLAGS if source.name in STRICT_SOURCES else [])

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES: dict[str, tuple[object, list[object]]] = {  # function -> (restype, argtypes)
    "decode_attention_bf16": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i32, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _f32, _i32]),
    "decode_attention_bf16_generic": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i32, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _f32]),
    "decode_attention_bf16_rows": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i32, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _f32, _i32]),
    "decode_attention_bf16_vectorized": (ctypes.c_int, [_i32, _i32]),
    "add_rms_norm_bf16": (None, [_p, _i64, _p, _i64, _p, _p, _i64, _i64, _i32, _f32]),
    "rope_bf16": (None, [_p, _i64, _i64, _i32, _i32, _p, _p, _p]),
    "silu_mul_bf16": (None, [_p, _i64, _p, _i64, _i64, _i32]),
    "linear_bf16_supported": (ctypes.c_int, []),
    "linear_bf16_packed_elements": (ctypes.c_int64, [_i32, _i32]),
    "linear_bf16_pack": (None, [_p, _i32, _i32, _p]),
    "linear_bf16": (None, [_p, _i64, _p, _p, _p, _i64, _i32, _i32, _i32]),
    "linear_bf16_f32": (None, [_p, _i64, _p, _p, _p, _i64, _i32, _i32, _i32]),
    "llama_layers_bf16": (ctypes.c_int, [_p, _i32, _i32, _i32, _i32, _i32, _i32, _f32, _i32,
                                         _p, _p, _p, _p, _p, _p, _p, _p, _i32, _p, _p, _p, _p, _p,
                                         _p, _p, _i32, _p, _f32, _p, _p, _p, _p, _p, _p, _p, _i32, _i32,
                                         _i32, _p, _p, _i32]),
    "linear_amx_supported": (ctypes.c_int, []),
    "linear_amx_pack": (None, [_p, _i32, _i32, _p]),
    "linear_amx": (None, [_p, _i64, _p, _p, _p, _i64, _i32, _i32, _i32]),
    "prompt_attention_amx": (ctypes.c_int, [_p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _i32, _f32, _p, _i64]),
    "attention_block_bf16": (ctypes.c_int, [_p, _i32, _i32, _i32, _i32, _p, _p, _p, _p, _i32, _p, _p, _i32, _p, _p,
                                            _i32, _p, _f32, _p, _i32, _i32]),
    "linear_gguf_supported": (ctypes.c_int, [_i32, _i32, _i32]),
    "linear_gguf_packed_bytes": (ctypes.c_int64, [_i32, _i32, _i32]),
    "linear_gguf_pack": (ctypes.c_int, [_p, _i32, _i32, _i32, _p]),
    "linear_gguf_rows": (ctypes.c_int, [_p, _i32, _i32, _i32, _p, _i32, _p]),
    "linear_gguf": (ctypes.c_int, [_p, _i64, _p, _i32, _p, _p, _i64, _i32, _i32, _i32, _i32]),
    "kv_rows_write": (None, [_i32, _p, _p, _i64, _i32]),
    "kv_rows_read": (ctypes.c_int, [_i32, _p, _p, _i64, _i32]),
    "argmax_rows_bf16": (None, [_p, _i64, _i64, _i64, _p]),
    "lora_add_f32": (ctypes.c_int, [_p, _i64, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32, _i32]),
    "lora_add_bf16": (ctypes.c_int, [_p, _i64, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32, _i32]),
    "lora_add_bf16_dp": (ctypes.c_int, [_p, _i64, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i32, _i32]),
    "lora_bf16_dp_supported": (ctypes.c_int, []),
    "argmax_rows_f32": (None, [_p, _i64, _i64, _i64, _p]),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("HETERO_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hetero-infer" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [p.read_text() for p in SOURCES + HEADERS] + [" ".join(COMPILE_FLAGS + STRICT_FLAGS + sorted(STRICT_SOURCES) + LINK_FLAGS), version, _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = cache_dir() / f"hetero_cpu_kernels-{key[:16]}.so"
    if not target.exists():
        build_library(compiler, SOURCES, target)
    return target


def find_compiler() -> str | None:
    """The host's C compiler: $CC, else cc, else gcc on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(compiler: str, sources: list[Path], target: Path) -> None:
    """Compile `sources` (their headers beside them) into the shared library `target`, built aside and renamed
    in, so that concurrent workers are safe. Also used to build another revision's kernels for an A/B
    (benchmarks/kernel_ab.py). Raises RuntimeError with the compiler's message on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in sources]
        steps = [[compiler, *compile_flags(source), "-c", str(source), "-o", obj] for source, obj in zip(sources, objects)]
        steps.append([compiler, *LINK_FLAGS, *objects, "-o", str(built), "-lm"])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step[:2])} ... failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Set every kernel's ctypes signature on `library` (AttributeError if one is missing)."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes
    return library


def load() -> ctypes.CDLL | None:
    """The library, building it the first time; None (reason: `unavailable_reason()`) when it cannot be."""
    global _library, _failure
    if _library is not None:  # the per-call path (every fused op of every layer): no lock
        return _library
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        compiler = find_compiler()
        if compiler is None:
            _failure = "no C compiler (cc, gcc or $CC) on PATH"
        else:
            try:
                _library = bind(ctypes.CDLL(str(_build(compiler))))
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                _failure = f"building the CPU kernels failed: {e}"
        if _failure:
            log.warning("CPU C kernels unavailable; using the torch code instead", reason=_failure)
        return _library


def unavailable_reason() -> str | None:
    load()
    return _failure
