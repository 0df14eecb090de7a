#!/usr/bin/env bash
# Prepare, on a machine with the package registries, what the offline GPU machine needs for the
# FlashInfer path: flashinfer-python (a JIT-only wheel) and apache-tvm-ffi, plus the project's own
# runtime and test dependencies that the GPU image lacks (it has torch, numpy, packaging, requests,
# tqdm, nvidia-ml-py, ninja), all for CPython 3.12 manylinux x86_64. The wheels are repacked as one
# xz-compressed tree, .flashinfer_carry/wheels.tar.xz (git-ignored, about 31 MiB: under the 64 MiB
# the device tool carries), which travels with the working tree; scripts/gpu_run.sh turns it back
# into wheels there and installs them with `pip install --no-index --no-deps --target`.
#
#   bash scripts/gpu_carry.sh            # then carry .flashinfer_carry/wheels.tar.xz with the tree
#   FLASHINFER_VERSION=... PYTHON=... bash scripts/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
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
    "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi>=0.1.11,<0.2"
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
rm -rf "$carry/wheels.tar.xz" "$carry/site" "$carry/wheels"
"$PY" scripts/wheel_tree.py pack "$work/wheels" "$carry/wheels.tar.xz"
size=$(stat -c %s "$carry/wheels.tar.xz")
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "gpu_carry: $carry/wheels.tar.xz is $((size / 1048576)) MiB, too close to the 64 MiB carry limit" >&2
    exit 1
fi
echo "gpu_carry: ready. Carry $carry (git-ignored) with the working tree, then run: bash scripts/gpu_run.sh"
