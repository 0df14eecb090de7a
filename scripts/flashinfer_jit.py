"""Compile FlashInfer's JIT modules that the worker selects (kernels/flashinfer_jit.py), ahead of use.

    python scripts/flashinfer_jit.py compile   # no GPU needed: object files only, stops before the link
    python scripts/flashinfer_jit.py compile --record  # the same, then the inputs' digest into
                                               # tests/gpu/flashinfer_compile.sha256 (the compile check skips
                                               # while the inputs match it)
    python scripts/flashinfer_jit.py digest    # print the inputs' digest and the recorded one
    python scripts/flashinfer_jit.py aot --out DIR  # no GPU needed: every module the GPU run uses, linked against
                                               # a stub libcuda, as DIR/<name>/<name>.so (scripts/gpu_carry.sh)
    python scripts/flashinfer_jit.py build     # on the GPU machine: compile, link and load each module
    python scripts/flashinfer_jit.py loaded    # on the GPU machine: every module is a prebuilt one (flashinfer's
                                               # data/aot), and loads with FLASHINFER_DISABLE_JIT=1

Each prints one line per module with its time. `compile` needs nvcc (CUDA_HOME, default
/usr/local/cuda) and targets FLASHINFER_CUDA_ARCH_LIST (default 9.0a); `build` takes the
architecture of the visible GPU unless that variable is set. The JIT cache is FlashInfer's
(FLASHINFER_WORKSPACE_BASE/.cache/flashinfer); a module already built is not compiled again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.flashinfer_jit import (  # noqa: E402
    CHECKED_SHAPES,
    DEVICE_SHAPES,
    arch_from_env,
    build_and_load,
    compile_inputs_digest,
    compile_objects,
    libcuda_stub,
    link_module,
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


RECORD = ROOT / "tests" / "gpu" / "flashinfer_compile.sha256"


def toolchain(cuda_home: str) -> str:
    """What the compile takes from outside FlashInfer: nvcc's release line and the pins of the headers' wheels."""
    import subprocess

    nvcc = subprocess.run([str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    release = next((line for line in nvcc.stdout.splitlines() if "release" in line), "no nvcc")
    return release + "\n" + (ROOT / "scripts" / "flashinfer_host.sh").read_text()


def recorded_digest() -> str | None:
    """The digest of the inputs the compile check last passed on (tests/gpu/flashinfer_compile.sha256)."""
    if not RECORD.exists():
        return None
    return next((line.strip() for line in RECORD.read_text().splitlines() if line and not line.startswith("#")), None)


def write_record(digest: str, specs: list[tuple[str, object]]) -> None:
    RECORD.write_text("# The digest of the FlashInfer compile check's inputs when it last passed: written by\n"
                      "# `python scripts/flashinfer_jit.py compile --record`; tests/gpu/test_flashinfer_compile.py\n"
                      "# compiles again only when today's inputs differ (kernels/flashinfer_jit.py\n"
                      "# compile_inputs_digest). The modules:\n"
                      + "".join(f"#   {spec.name}\n" for _, spec in specs) + digest + "\n")


def link_flags_with_libcuda(cuda_home: str, stub_folder: Path) -> None:
    """FLASHINFER_EXTRA_LDFLAGS gains a folder with a `libcuda.so` when CUDA_HOME's stubs have none (the CI image)."""
    if (Path(cuda_home) / "lib64" / "stubs" / "libcuda.so").exists():
        return
    stub = libcuda_stub(stub_folder)
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"{os.environ.get('FLASHINFER_EXTRA_LDFLAGS', '')} -L{stub.parent}".strip()
    print(f"libcuda for the link: the stub {stub}", flush=True)


def write_prebuilt(specs: list[tuple[str, object]], out: Path, jobs: int, arch: str) -> None:
    """Every module linked and copied to out/<name>/<name>.so (the layout of flashinfer's data/aot folder, where
    FlashInfer loads a module without compiling it), with out/manifest.json naming them."""
    import flashinfer

    out.mkdir(parents=True, exist_ok=True)
    names = []
    for users, spec in specs:
        t0 = time.perf_counter()
        library = link_module(spec, jobs)
        (out / spec.name).mkdir(exist_ok=True)
        shutil.copy2(library, out / spec.name / f"{spec.name}.so")
        names.append(spec.name)
        print(f"  {time.perf_counter() - t0:7.1f} s  {spec.name} ({library.stat().st_size / 2**20:.1f} MiB; {users})",
              flush=True)
    (out / "manifest.json").write_text(json.dumps({"flashinfer": flashinfer.__version__, "arch": arch,
                                                   "modules": names}, indent=1) + "\n")


def check_loaded(specs: list[tuple[str, object]]) -> int:
    """On the GPU machine: each module resolves to a prebuilt library in flashinfer's data/aot and loads from it
    with the JIT disabled. 0 when all do; else the count that did not, each named."""
    from flashinfer.jit import env as jit_env

    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    missing = 0
    for users, spec in specs:
        t0 = time.perf_counter()
        path = jit_env.get_aot_path(spec.name)
        if not spec.is_aot or jit_env.FLASHINFER_AOT_DIR not in path.parents:
            print(f"  MISSING  {spec.name}: no prebuilt {path} ({users})", flush=True)
            missing += 1
            continue
        spec.build_and_load()
        print(f"  {time.perf_counter() - t0:7.1f} s  {spec.name} (prebuilt {path})", flush=True)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["compile", "digest", "aot", "build", "loaded"])
    parser.add_argument("--record", action="store_true", help="compile: write the inputs' digest once it passed")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count())
    parser.add_argument("--out", type=Path, help="aot: the folder for the prebuilt modules")
    args = parser.parse_args(argv)
    if args.what == "aot" and args.out is None:
        parser.error("aot needs --out DIR")
    # Without CUDA_HOME, FlashInfer takes nvcc's grandparent: /usr/local when nvcc is the
    # /usr/local/bin link, where neither the CUDA headers nor libcudart are.
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ.setdefault("MAX_JOBS", str(args.jobs))  # FlashInfer's own ninja runs read it
    for include in library_includes(os.environ["CUDA_HOME"]):  # both here and on the GPU machine
        os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{os.environ.get('FLASHINFER_EXTRA_CUDAFLAGS', '')} -isystem {include}"
        print(f"library headers from {include}", flush=True)
    if args.what in ("compile", "digest", "aot"):
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        capability = arch_from_env()
    else:
        import torch

        capability = torch.cuda.get_device_capability() if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ \
            else arch_from_env()
    if args.what == "aot":
        link_flags_with_libcuda(os.environ["CUDA_HOME"], ROOT / "build" / "libcuda-stub")
    modules = unique_specs(CHECKED_SHAPES if args.what in ("compile", "digest") else DEVICE_SHAPES, capability)
    if args.what == "digest":
        print(f"inputs {compile_inputs_digest(modules, toolchain(os.environ['CUDA_HOME']))}")
        print(f"recorded {recorded_digest()}")
        return 0
    print(f"flashinfer {args.what}: {len(modules)} modules for sm{capability[0]}{capability[1]}, "
          f"CUDA_HOME={os.environ['CUDA_HOME']}, {args.jobs} jobs", flush=True)
    started = time.perf_counter()
    if args.what == "aot":
        write_prebuilt(modules, args.out, args.jobs, os.environ["FLASHINFER_CUDA_ARCH_LIST"])
    elif args.what == "loaded":
        missing = check_loaded(modules)
        if missing:
            print(f"flashinfer loaded: {missing} of {len(modules)} modules have no prebuilt library", flush=True)
            return 1
    else:
        for users, spec in modules:
            t0 = time.perf_counter()
            if args.what == "compile":
                detail = f"{len(compile_objects(spec, args.jobs))} objects"
            else:
                build_and_load(spec)
                detail = "loaded"
            print(f"  {time.perf_counter() - t0:7.1f} s  {spec.name} ({detail}; {users})", flush=True)
        if args.record:
            write_record(compile_inputs_digest(modules, toolchain(os.environ["CUDA_HOME"])), modules)
            print(f"recorded the inputs' digest in {RECORD.relative_to(ROOT)}", flush=True)
    print(f"flashinfer {args.what}: done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
