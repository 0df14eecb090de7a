#!/usr/bin/env bash
# Run on the offline GPU machine from the repository root, after scripts/gpu_carry.sh prepared
# .flashinfer_carry/wheels.tar.xz and it was copied there with the working tree:
#   1. rebuilds the carried wheels and installs them into .flashinfer_carry/site with
#      `pip install --no-index --no-deps --target` (once; kept while the machine stays warm);
#   2. puts that folder first on PYTHONPATH, sets FLASHINFER_CUDA_ARCH_LIST (9.0a: H100/H200) and
#      keeps FlashInfer's JIT cache under .flashinfer_carry/ too;
#   3. runs the GPU tests (pytest -m gpu) and the GPU benchmark.
# Logs (and gpu_bench.json) go to $OUT when set (the device tool's output folder), else bench_results/gpu/.
#
#   bash scripts/gpu_run.sh [all|tests|bench] [benchmark flags...]
# The first run compiles FlashInfer's kernels (JIT, minutes); if a call runs out of time, run it
# again on the still-warm machine: compiled kernels are cached under .flashinfer_carry/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-all}
[ $# -gt 0 ] && shift
case "$what" in all|tests|bench) ;; *) echo "usage: bash scripts/gpu_run.sh [all|tests|bench] [benchmark flags...]" >&2; exit 2;; esac
carry=$PWD/.flashinfer_carry
site=$carry/site
out=${OUT:-bench_results/gpu}
mkdir -p "$out"
if [ ! -d "$site/flashinfer" ]; then
    if [ ! -f "$carry/wheels.tar.xz" ]; then
        echo "gpu_run: $carry/wheels.tar.xz is missing: run scripts/gpu_carry.sh on a machine with package registries, then carry .flashinfer_carry with the working tree" >&2
        exit 2
    fi
    "$PY" scripts/wheel_tree.py unpack "$carry/wheels.tar.xz" "$carry/wheels" || exit 2
    "$PY" -m pip install --no-index --no-deps --no-compile --target "$site" "$carry"/wheels/*.whl 2>&1 | tail -2
    rm -rf "$carry/wheels"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$carry}  # JIT cache: $carry/.cache/flashinfer
# FlashInfer's JIT needs nvcc (CUDA_HOME, PATH or /usr/local/cuda) and ninja on this machine.
{ echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo 'not found')"; } | tee "$out/gpu_env.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$out/gpu_env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
import flashinfer
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
PYEOF
tests_rc=0
bench_rc=0
if [ "$what" != bench ]; then
    started=$(date +%s)
    "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
    echo "gpu tests: rc=$tests_rc, $(( $(date +%s) - started )) s (the first run includes FlashInfer's JIT compilation)"
fi
if [ "$what" != tests ]; then
    started=$(date +%s)
    "$PY" benchmarks/gpu_bench.py --json "$out/gpu_bench.json" "$@" 2>&1 | tee "$out/gpu_bench.log"
    bench_rc=${PIPESTATUS[0]}
    echo "gpu benchmark: rc=$bench_rc, $(( $(date +%s) - started )) s"
fi
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
