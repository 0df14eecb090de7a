"""FlashInfer's JIT modules for the worker, compiled without a GPU (kernels/flashinfer_jit.py).

The slow test compiles every module the worker selects for the checked shapes (the default model,
head_dim-64 and head_dim-128 Llamas, a GQA group of 7; prefill, decode, graph-mode decode), and the fused
element-wise modules (RMSNorm, RoPE, SiLU·mul: kernels/flashinfer_fused.py), for
sm_90a up to the object files, and stops before the link (no libcuda without a driver): a
template or API mismatch with flashinfer-python 0.7.2.post1 fails here, before a GPU is lent.
It needs flashinfer-python (scripts/test.sh installs it) and nvcc (CUDA_HOME, default
/usr/local/cuda); without flashinfer the tests skip. Cold it takes 11-16 minutes on 2 cores (compiled objects
are kept in build/flashinfer-jit, so a rerun recompiles only what changed), so it runs only when its inputs
changed: the modules selected, their sources (FlashInfer's generated ones), FlashInfer's version, nvcc's release
and the header wheels' pins (kernels/flashinfer_jit.py compile_inputs_digest). Their digest when it last passed
is recorded in tests/gpu/flashinfer_compile.sha256: while today's matches, the test skips, saying so; when it
differs, the test compiles everything, and fails even when that passes, until the new digest is recorded with
`python scripts/flashinfer_jit.py compile --record` (which writes it only after a compile that passed).
HETERO_FLASHINFER_COMPILE=always compiles whatever the digest says.
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
RECORD = ROOT / "tests" / "gpu" / "flashinfer_compile.sha256"
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


def _jit_script(what: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "flashinfer_jit.py"), what], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_flashinfer
def test_every_selected_flashinfer_module_compiles_for_sm90a() -> None:
    env = {**os.environ, "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
           "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
           "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE", str(ROOT / "build" / "flashinfer-jit"))}
    assert Path(env["CUDA_HOME"], "bin", "nvcc").exists(), f"no nvcc under CUDA_HOME={env['CUDA_HOME']}"
    digest = _jit_script("digest", env)
    assert digest.returncode == 0, digest.stdout[-4000:]
    lines = dict(line.split(" ", 1) for line in digest.stdout.splitlines() if line.startswith(("inputs ", "recorded ")))
    if lines["inputs"] == lines["recorded"] and os.environ.get("HETERO_FLASHINFER_COMPILE") != "always":
        pytest.skip(f"the compile check's inputs are those it last passed on ({lines['inputs'][:12]}, "
                    f"{RECORD.name}): nothing to compile again")
    done = _jit_script("compile", env)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-8000:]
    assert lines["inputs"] == lines["recorded"], (
        f"every module compiles, but {RECORD.relative_to(ROOT)} records other inputs ({lines['recorded']}, today "
        f"{lines['inputs']}): run `python scripts/flashinfer_jit.py compile --record` and commit the file")


def test_the_digest_follows_each_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever changes the compile's outcome changes the digest; where the checkout lies does not."""
    pytest.importorskip("flashinfer")
    from types import SimpleNamespace

    from kernels.flashinfer_jit import compile_inputs_digest

    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

    def specs(folder: str, source_text: str = "kernel", name: str = "decode", flags: list[str] | None = None):
        source = tmp_path / folder / "batch_decode.cu"
        source.parent.mkdir(exist_ok=True)
        source.write_text(source_text)
        spec = SimpleNamespace(name=name, sources=[source], extra_cflags=None, extra_cuda_cflags=flags or ["-O3"],
                               extra_ldflags=None, needs_device_linking=False)
        return [("users", spec)]

    base = compile_inputs_digest(specs("a"), "release 13.0")
    assert compile_inputs_digest(specs("b"), "release 13.0") == base  # another checkout, same inputs
    assert compile_inputs_digest(specs("c", source_text="kernel 2"), "release 13.0") != base
    assert compile_inputs_digest(specs("d", name="prefill"), "release 13.0") != base
    assert compile_inputs_digest(specs("e", flags=["-O2"]), "release 13.0") != base
    assert compile_inputs_digest(specs("f"), "release 13.1") != base
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "10.0a")
    assert compile_inputs_digest(specs("g"), "release 13.0") != base


def test_the_record_holds_one_digest() -> None:
    lines = [line for line in RECORD.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1 and len(lines[0]) == 64 and int(lines[0], 16) >= 0, lines
