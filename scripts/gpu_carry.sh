#!/usr/bin/env bash
# Prepare, on a machine with the package registries (no GPU needed), what the offline GPU machine needs for
# the FlashInfer path, in the git-ignored .flashinfer_carry/ that travels with the working tree:
#
# - wheels.tar.xz: flashinfer-python (a JIT-only wheel) and apache-tvm-ffi, plus the project's own runtime
#   and test dependencies that the GPU image lacks (it has torch, numpy, packaging, requests, tqdm,
#   nvidia-ml-py, ninja), all for CPython 3.12 manylinux x86_64, repacked as one xz-compressed tree;
#   scripts/gpu_run.sh turns it back into wheels there and installs them with `pip install --no-index
#   --no-deps --target`.
# - aot.tar.xz: every FlashInfer module the GPU run selects (kernels/flashinfer_jit.py DEVICE_SHAPES and the
#   fused element-wise ones), compiled and linked here for sm_90a with nvcc against a stub libcuda
#   (scripts/flashinfer_jit.py aot); gpu_run.sh puts them in flashinfer's data/aot, where FlashInfer loads a
#   module without compiling it. Cold, the build takes about half an hour on 2 cores (the two FA3 prefill
#   modules 10-12 minutes each); objects are kept in build/flashinfer-jit (the compile check's), so a rebuild
#   in the same checkout compiles only what changed.
# - commit: the commit the carry was built at, for the figures' rows when the device has no git.
#
# The script prints each part's size and fails when together they come near the device tool's 64 MiB.
#
#   bash scripts/gpu_carry.sh            # then carry .flashinfer_carry with the tree
#   FLASHINFER_VERSION=... PYTHON=... bash scripts/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}
# The modules' build imports the project (torch included): a fresh clone gets its .venv first.
if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then
    bash scripts/setup.sh
fi
PY=${PYTHON:-.venv/bin/python}
carry=.flashinfer_carry
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# abi3 and manylinux_2_31: llguidance ships only cp39-abi3-manylinux_2_31 wheels (the GPU image's glibc is newer).
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)

# FlashInfer and its FFI layer. Its other declared dependencies (cuda-python, cuda-tile, cutlass-dsl,
# cudnn-frontend, nccl4py, einops, tabulate, click) are not needed to import it and JIT-compile
# the paged attention kernels used here: left out to stay under the carry limit.
"$PY" -m pip download --no-deps "${target[@]}" -d "$work/wheels" \
    "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION"
# What the runtime (serving included), the GPU tests, the benchmark and the JIT build import beyond the
# GPU image's own packages (scripts/gpu_image_packages.txt, from the device tool's KINDS.md), at
# pyproject.toml's pins; and what these carried packages require beyond the image, since --no-deps
# fetches none of it. tests/gpu/test_gpu_carry.py reads these lines and checks that they, with the
# image, cover every third-party import.
"$PY" -m pip download --no-deps "${target[@]}" -d "$work/wheels" \
    "grpcio>=1.85,<1.86" "grpcio-health-checking>=1.85,<1.86" "grpcio-reflection>=1.85,<1.86" \
    "grpcio-tools>=1.85,<1.86" "protobuf>=7.35.1,<8" "structlog>=24.1" "tenacity>=8.2" "gguf>=0.10" \
    "tokenizers>=0.20.1" "llguidance==1.9.1" "safetensors>=0.4" "jinja2>=3.1" markupsafe "typing-extensions>=4.12" \
    "pytest>=8" pluggy iniconfig pygments "pytest-timeout>=2.3"
# The OpenAI HTTP API's stack. pydantic pins pydantic-core exactly: fetched together with their
# dependencies resolved for the target (pip picks the matching pydantic-core), then nothing else.
"$PY" -m pip download "${target[@]}" -d "$work/wheels" \
    "fastapi>=0.110" "uvicorn>=0.29" starlette pydantic pydantic-core annotated-types typing-inspection \
    annotated-doc opentelemetry-api
ls -l "$work/wheels"
mkdir -p "$carry"
rm -rf "$carry/wheels.tar.xz" "$carry/aot.tar.xz" "$carry/site" "$carry/wheels"
"$PY" scripts/wheel_tree.py pack "$work/wheels" "$carry/wheels.tar.xz"

# The modules, built ahead with the same FlashInfer and FFI layer as carried (their headers are compiled in).
PY="$PY" FLASHINFER_VERSION="$FLASHINFER_VERSION" TVM_FFI_VERSION="$TVM_FFI_VERSION" bash scripts/flashinfer_host.sh
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} \
    FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/build/flashinfer-jit} \
    "$PY" scripts/flashinfer_jit.py aot --out "$work/aot"
XZ_OPT=-9e tar -cJf "$carry/aot.tar.xz" -C "$work/aot" .
git rev-parse --short HEAD > "$carry/commit" 2>/dev/null || echo unknown > "$carry/commit"

wheels=$(stat -c %s "$carry/wheels.tar.xz")
aot=$(stat -c %s "$carry/aot.tar.xz")
total=$((wheels + aot))
echo "gpu_carry: wheels.tar.xz $((wheels / 1048576)) MiB + aot.tar.xz $((aot / 1048576)) MiB" \
     "($(du -sm "$work/aot" | cut -f1) MiB unpacked) = $((total / 1048576)) MiB of the 64 MiB a device run carries"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "gpu_carry: $carry is $((total / 1048576)) MiB, too close to the 64 MiB carry limit with the tree beside it" >&2
    exit 1
fi
echo "gpu_carry: ready. Carry $carry (git-ignored) with the working tree, then run: bash scripts/gpu_run.sh first"
