"""FlashInfer's JIT modules for the worker, compiled without a GPU (kernels/flashinfer_jit.py).

The slow test compiles every module the worker selects for the checked shapes (the default model,
head_dim-64 and head_dim-128 Llamas, a GQA group of 7; prefill, decode, graph-mode decode), and the fused
element-wise modules (RMSNorm, RoPE, SiLU·mul: kernels/flashinfer_fused.py), for
sm_90a up to the object files, and stops before the link (no libcuda without a driver): a
template or API mismatch with flashinfer-python 0.7.2.post1 fails here, before a GPU is lent.
It needs flashinfer-python (scripts/test.sh installs it) and nvcc (CUDA_HOME, default
/usr/local/cuda); without flashinfer the tests skip. Measured on 2 cores: about 11 minutes cold;
compiled objects are kept in build/flashinfer-jit, so a rerun recompiles only what changed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="flashinfer-python is not installed (scripts/test.sh installs it)")


def test_arch_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.flashinfer_jit import arch_from_env

    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a 10.0a")
    assert arch_from_env() == (9, 0)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "8.0")
    assert arch_from_env() == (8, 0)


@needs_flashinfer
def test_module_choice_follows_the_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA-core decode up to a GQA group of 4, else FA2 through tensor cores; FA3 prefill on sm90
    only; eager and graph-mode decode build one module; one `page` module for every shape."""
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # spec generation asks for a target
    from kernels.flashinfer_jit import CHECKED_SHAPES, AttentionShape, module_specs, unique_specs

    small = module_specs(AttentionShape("g3", 9, 3, 64), (9, 0))
    assert small["decode"].name.startswith("batch_decode_") and "head_dim_qk_64" in small["decode"].name
    assert small["graph decode"] is small["decode"] and small["append"].name == "page"
    assert small["prefill"].name.endswith("_sm90")
    wide = module_specs(AttentionShape("g7", 28, 4, 128, torch.float16), (9, 0))
    assert wide["decode"].name.startswith("batch_prefill_") and not wide["decode"].name.endswith("_sm90")
    assert "dtype_q_f16" in wide["decode"].name and "head_dim_qk_128" in wide["prefill"].name
    assert not module_specs(AttentionShape("a100", 32, 8, 128), (8, 0))["prefill"].name.endswith("_sm90")
    names = [spec.name for _, spec in unique_specs(CHECKED_SHAPES, (9, 0))]
    # page; decode 64, 128; FA3 prefill 64, 128; FA2 (group 7); then the fused element-wise norm, rope, silu_and_mul
    assert len(names) == len(set(names)) == 9
    assert names[-3:] == ["norm", "rope", "silu_and_mul"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_flashinfer
def test_every_selected_flashinfer_module_compiles_for_sm90a() -> None:
    env = {**os.environ, "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
           "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
           "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE", str(ROOT / "build" / "flashinfer-jit"))}
    assert Path(env["CUDA_HOME"], "bin", "nvcc").exists(), f"no nvcc under CUDA_HOME={env['CUDA_HOME']}"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "flashinfer_jit.py"), "compile"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-8000:]
