"""Compile FlashInfer's JIT modules that the worker selects (kernels/flashinfer_jit.py), ahead of use.

    python scripts/flashinfer_jit.py compile   # no GPU needed: object files only, stops before the link
    python scripts/flashinfer_jit.py build     # on the GPU machine: compile, link and load each module

Both print one line per module with its time. `compile` needs nvcc (CUDA_HOME, default
/usr/local/cuda) and targets FLASHINFER_CUDA_ARCH_LIST (default 9.0a); `build` takes the
architecture of the visible GPU unless that variable is set. The JIT cache is FlashInfer's
(FLASHINFER_WORKSPACE_BASE/.cache/flashinfer); a module already built is not compiled again.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.flashinfer_jit import (  # noqa: E402
    CHECKED_SHAPES,
    DEVICE_SHAPES,
    arch_from_env,
    build_and_load,
    compile_objects,
    unique_specs,
)


# Library headers FlashInfer's modules include beyond the CUDA runtime's: FA3's CUTLASS code includes cuRAND's,
# the norm module (kernels/flashinfer_fused.py) cuBLASLt's.
LIBRARY_HEADERS = ("curand_kernel.h", "cublasLt.h")


def library_includes(cuda_home: str) -> list[str]:
    """Folders holding the LIBRARY_HEADERS that CUDA_HOME lacks (none when it has them all, or none is found).

    A CUDA install with nvcc and the runtime only (the CI image's) has neither library; their wheels ship the
    headers (nvidia/cu13/include: nvidia-curand's, and cuBLAS's as scripts/cuda_headers.py unpacks them)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    bases = [Path(b) for b in ((spec.submodule_search_locations or []) if spec else [])]
    found: list[str] = []
    for name in LIBRARY_HEADERS:
        if (Path(cuda_home) / "include" / name).exists():
            continue
        folder = next((str(h.parent) for base in bases for h in sorted(base.glob(f"*/include/{name}"))), None)
        if folder is not None and folder not in found:
            found.append(folder)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["compile", "build"])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count())
    args = parser.parse_args(argv)
    # Without CUDA_HOME, FlashInfer takes nvcc's grandparent: /usr/local when nvcc is the
    # /usr/local/bin link, where neither the CUDA headers nor libcudart are.
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ.setdefault("MAX_JOBS", str(args.jobs))  # FlashInfer's own ninja runs read it
    for include in library_includes(os.environ["CUDA_HOME"]):  # both here and on the GPU machine
        os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{os.environ.get('FLASHINFER_EXTRA_CUDAFLAGS', '')} -isystem {include}"
        print(f"library headers from {include}", flush=True)
    if args.what == "compile":
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        capability = arch_from_env()
    else:
        import torch

        capability = torch.cuda.get_device_capability() if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ \
            else arch_from_env()
    modules = unique_specs(CHECKED_SHAPES if args.what == "compile" else DEVICE_SHAPES, capability)
    print(f"flashinfer {args.what}: {len(modules)} modules for sm{capability[0]}{capability[1]}, "
          f"CUDA_HOME={os.environ['CUDA_HOME']}, {args.jobs} jobs", flush=True)
    started = time.perf_counter()
    for users, spec in modules:
        t0 = time.perf_counter()
        if args.what == "compile":
            detail = f"{len(compile_objects(spec, args.jobs))} objects"
        else:
            build_and_load(spec)
            detail = "loaded"
        print(f"  {time.perf_counter() - t0:7.1f} s  {spec.name} ({detail}; {users})", flush=True)
    print(f"flashinfer {args.what}: done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
