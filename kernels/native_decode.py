"""The C decode-attention kernel (kernels/native/decode_attention.c), built on first use.

The pure-torch decode gathers every sequence's K/V pages into a copy padded to the longest
sequence, then runs two batched matmuls over it: three passes over memory, and the padding.
The C kernel reads each K and V row once, in place, and only the rows a sequence has.

Built with the host's C compiler (`cc`, or `$CC`) into a per-user cache keyed by the source,
the flags, the compiler and the CPU's flags (`-march=native`), in about a second; no torch
headers, loaded with ctypes. Where it cannot be built (no compiler, a failed build) the caller
falls back to the torch path and the reason is logged once. OpenMP: the library is loaded after
torch, so it shares torch's libgomp and its thread count (`torch.set_num_threads`).
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
import torch

log = structlog.get_logger("kernels.native_decode")

SOURCE = Path(__file__).resolve().parent / "native" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # the kernel's limits (decode_attention.c)

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
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"decode_attention-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed in: concurrent workers are safe
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, building it the first time; None (reason: `unavailable_reason()`) when it cannot be."""
    global _library, _failure
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            _failure = "no C compiler (cc, gcc or $CC) on PATH"
        else:
            try:
                library = ctypes.CDLL(str(_build(compiler)))
                fn = library.decode_attention_bf16
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
                _library = library
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _failure = f"building {SOURCE.name} failed: {e}"
        if _failure:
            log.warning("C decode attention unavailable; using the torch decode path", reason=_failure)
        return _library


def unavailable_reason() -> str | None:
    load()
    return _failure


def supports(dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes and dtypes the kernel takes (the library itself may still be unavailable: `load()`)."""
    return (dtype == torch.bfloat16 and head_dim <= MAX_HEAD_DIM and num_qo_heads % num_kv_heads == 0
            and num_qo_heads // num_kv_heads <= MAX_GROUP)


def decode_attention(q: torch.Tensor, q_rows: torch.Tensor, layer_cache: torch.Tensor, pages: torch.Tensor,
                     kv_lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """out[q_rows[b]] = attention of q[q_rows[b]] over sequence b's first kv_lens[b] cached tokens.

    q, out [T, Hq, D] bfloat16 (rows may be strided, heads contiguous); q_rows int64 [B];
    layer_cache [blocks, 2, Hkv, bs, D] bfloat16 contiguous; pages int32 [B, P]; kv_lens int32 [B].
    The caller checks `supports` and that `load()` succeeded.
    """
    library = _library
    assert library is not None, "decode_attention before a successful load()"
    num_seqs, num_qo_heads, head_dim = q_rows.shape[0], q.shape[1], q.shape[2]
    num_kv_heads, block_size = layer_cache.shape[2], layer_cache.shape[3]
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be bfloat16 [T, Hq, D] with contiguous heads")
    if not (layer_cache.is_contiguous() and pages.is_contiguous() and kv_lens.is_contiguous()
            and q_rows.is_contiguous()):
        raise ValueError("layer_cache, pages, kv_lens and q_rows must be contiguous")
    rc = library.decode_attention_bf16(
        q.data_ptr(), q.stride(0), q_rows.data_ptr(), layer_cache.data_ptr(), pages.data_ptr(), pages.shape[1],
        kv_lens.data_ptr(), out.data_ptr(), out.stride(0), num_seqs, num_qo_heads, num_kv_heads, head_dim,
        block_size, scale)
    if rc != 0:
        raise RuntimeError(f"decode_attention_bf16 failed ({rc}): unsupported sizes or out of memory")
