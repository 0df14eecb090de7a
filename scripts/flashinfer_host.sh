#!/usr/bin/env bash
# FlashInfer on a machine without a GPU, into the active Python (scripts/test.sh's venv; scripts/gpu_carry.sh's):
# for the compile check (tests/gpu/test_flashinfer_compile.py) and for building the GPU run's modules ahead
# (scripts/flashinfer_jit.py aot). --no-deps: the package, its FFI layer and what importing it and its JIT need
# (about 120 MiB with cuRAND), not the `gpu` extra's CUDA Python libraries (cutlass-dsl, cudnn-frontend,
# nccl4py, ...: 290 MiB in all) that nothing here loads. nvidia-curand only for cuRAND's headers, which FA3's
# CUTLASS code includes; cuBLAS's six headers, not its libraries: FlashInfer's norm module (the fused RMSNorm)
# includes cublasLt.h. The FFI layer is pinned to the version gpu_carry.sh carries: the prebuilt modules are
# built against its headers.
#   PY=.venv/bin/python bash scripts/flashinfer_host.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}
"$PY" -m pip install --quiet --no-deps "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" \
    nvidia-ml-py ninja "nvidia-curand==10.4.0.35"
"$PY" scripts/cuda_headers.py "nvidia-cublas==13.10.0.20"
