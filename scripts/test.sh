#!/usr/bin/env bash
# Set up (test dependencies included) and run the whole suite: fast tests first, then the
# slow real-model and multi-process ones. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
# FlashInfer for the slow compile check (tests/gpu/test_flashinfer_compile.py: every module the worker
# selects, compiled for sm_90a up to the object files, ~11 min on 2 cores). --no-deps: the package,
# its FFI layer and what importing it and its JIT need (about 120 MiB with cuRAND), not the `gpu`
# extra's CUDA Python libraries (cutlass-dsl, cudnn-frontend, nccl4py, ...: 290 MiB in all) that
# nothing here loads. nvidia-curand only for cuRAND's headers, which FA3's CUTLASS code includes.
python -m pip install --quiet --no-deps "flashinfer-python==0.7.2.post1" "apache-tvm-ffi>=0.1.11,<0.2" \
    nvidia-ml-py ninja "nvidia-curand==10.4.0.35"
# cuBLAS's six headers, not its libraries: FlashInfer's norm module (the fused RMSNorm) includes cublasLt.h.
python scripts/cuda_headers.py "nvidia-cublas==13.10.0.20"
python -m hetero_infer.protogen --check
python -m pytest -q -m "not slow" "$@"
python -m pytest -q -m slow --durations=10 "$@"
