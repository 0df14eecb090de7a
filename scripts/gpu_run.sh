#!/usr/bin/env bash
# Run on the offline GPU machine from the repository root, after scripts/gpu_carry.sh prepared
# .flashinfer_carry/wheels.tar.xz and it was copied there with the working tree:
#
#   bash scripts/gpu_run.sh build    # install the carried wheels, JIT-compile FlashInfer's modules (minutes)
#   bash scripts/gpu_run.sh tests    # the GPU tests (pytest -m gpu tests/gpu)
#   bash scripts/gpu_run.sh bench [benchmark flags...]   # benchmarks/gpu_bench.py (--breakdown: a graph step's parts)
#   bash scripts/gpu_run.sh stepcost # benchmarks/step_cost.py: the stack's step against the engine's, on the GPU
#                                    # with a 1B-shaped model, then on this host's CPU cores with the tiny one
#   bash scripts/gpu_run.sh quant    # issue 39's GPU figures: fp8 weights (8B shape, batch 64) and fp8 KV
#                                    # (1B shape, batch 256, 4k contexts), each against bf16
#   bash scripts/gpu_run.sh all      # build, tests, bench and the 8B shape's bench in one call, when one call has the time
#   bash scripts/gpu_run.sh install  # only the carried wheels (then PYTHONPATH=$(ls -d /tmp/hetero-gpu/site-*):$PWD)
#
# One step per device call: a cold JIT alone can take most of a 600 s call. Every step first
# prints what the JIT needs (nvcc, CUDA_HOME, the libcuda stub) and fails at once without it.
# The installed wheels and FlashInfer's JIT cache live under $HETERO_GPU_STATE (/tmp/hetero-gpu),
# outside the tree: they survive the next call while the machine stays warm, and re-sending the
# tree (or the carry) does not wipe them. A step finding them missing redoes the install, and
# FlashInfer compiles what is not cached. Logs (and gpu_bench.json) go to $OUT when set (the device
# tool's output folder), else bench_results/gpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-all}
[ $# -gt 0 ] && shift
case "$what" in all|build|tests|bench|stepcost|quant|install) ;; *) echo "usage: bash scripts/gpu_run.sh [install|build|tests|bench|stepcost|quant|all] [benchmark flags...]" >&2; exit 2;; esac
out=${OUT:-bench_results/gpu}
mkdir -p "$out"
state=${HETERO_GPU_STATE:-/tmp/hetero-gpu}
archive=$PWD/.flashinfer_carry/wheels.tar.xz

# --- 1. what the JIT needs, printed before anything else ------------------------------------------
nvcc_path=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
if [ -z "${CUDA_HOME:-}" ]; then
    # nvcc's real folder, not a /usr/local/bin link's: FlashInfer takes CUDA_HOME from there.
    if [ -d /usr/local/cuda/include ]; then CUDA_HOME=/usr/local/cuda
    elif [ -n "$nvcc_path" ]; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
    fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # FlashInfer's ninja runs one compile per core
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # H100/H200: sm_90a, which FA3 needs
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$state}  # JIT cache: $state/.cache/flashinfer
stub=$CUDA_HOME/lib64/stubs/libcuda.so
libcuda_note="found"
if [ ! -e "$stub" ]; then
    # FlashInfer links -lcuda from $CUDA_HOME/lib64/stubs; without the stub, the driver's own
    # library serves, through a libcuda.so link in a folder added to its link flags.
    driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
    [ -z "$driver" ] && driver=$(ls /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null || true)
    if [ -n "$driver" ]; then
        mkdir -p "$state/libcuda" && ln -sf "$driver" "$state/libcuda/libcuda.so"
        export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:-} -L$state/libcuda"
        stub=$state/libcuda/libcuda.so
        libcuda_note="NOT FOUND; linking the driver's $driver instead"
    else
        libcuda_note="NOT FOUND, nor a driver libcuda.so.1"
    fi
fi
{
    echo "nvcc: ${nvcc_path:-NOT FOUND} ($("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no version'))"
    echo "CUDA_HOME=$CUDA_HOME; libcuda stub $CUDA_HOME/lib64/stubs/libcuda.so: $libcuda_note"
    echo "MAX_JOBS=$MAX_JOBS; FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST; JIT cache: $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer ($(find "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" -name '*.so' 2>/dev/null | wc -l) modules built)"
} | tee "$out/gpu_env.txt"
if [ ! -x "$CUDA_HOME/bin/nvcc" ] || [ ! -e "$stub" ]; then
    echo "gpu_run: FlashInfer's JIT needs $CUDA_HOME/bin/nvcc and $stub (it links -lcuda from there); set CUDA_HOME" >&2
    exit 2
fi

# --- 2. the carried wheels, installed once per archive ---------------------------------------------
if [ ! -f "$archive" ]; then
    echo "gpu_run: $archive is missing: run scripts/gpu_carry.sh on a machine with package registries, then carry .flashinfer_carry with the working tree" >&2
    exit 2
fi
site=$state/site-$(sha256sum "$archive" | cut -c1-16)
if [ ! -f "$site/.complete" ]; then
    # Into a fresh folder, renamed only once pip succeeded: a half-installed folder is never taken
    # for a finished one by a later call.
    rm -rf "$site" "$site.partial" "$state/wheels"
    mkdir -p "$state"
    "$PY" scripts/wheel_tree.py unpack "$archive" "$state/wheels" || exit 2
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site.partial" "$state"/wheels/*.whl; then
        echo "gpu_run: pip install of the carried wheels failed" >&2
        exit 2
    fi
    touch "$site.partial/.complete" && mv "$site.partial" "$site" && rm -rf "$state/wheels"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$out/gpu_env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
import flashinfer
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
PYEOF

# --- 3. the steps ----------------------------------------------------------------------------------
rc=0
step() {  # step NAME LOG COMMAND...: run, log, time, and remember a failure
    local name=$1 log=$2 started
    shift 2
    started=$(date +%s)
    "$@" 2>&1 | tee "$out/$log"
    local status=${PIPESTATUS[0]}
    echo "gpu_run $name: rc=$status, $(( $(date +%s) - started )) s"
    [ "$status" -eq 0 ] || rc=$status
}
if [ "$what" = build ] || [ "$what" = all ]; then
    # FlashInfer's JIT warm-up, timed per module: everything the worker, tests and benchmark select.
    step build gpu_build.log "$PY" scripts/flashinfer_jit.py build
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    step tests gpu_tests.log "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    step bench gpu_bench.log "$PY" benchmarks/gpu_bench.py --json "$out/gpu_bench.json" "$@"
fi
if [ "$what" = all ]; then  # issue 37's second shape: Llama-3.1-8B's, batch 1 and 64
    step bench-8b gpu_bench_8b.log "$PY" benchmarks/gpu_bench.py --shape 8b --batch-sizes 1,64 --steps 20 --prompt 512 \
        --json "$out/gpu_bench_8b.json"
fi
if [ "$what" = stepcost ]; then
    # FlashInfer compiles on first use what the build step did not (the 64-wide heads these models have).
    # Their logs hold the tables; no JSON: the device tool brings back at most 8 files.
    step stepcost-cuda step_cost_cuda.log "$PY" benchmarks/step_cost.py --device cuda --model llama-1b
    step stepcost-cpu step_cost_cpu.log "$PY" benchmarks/step_cost.py --device cpu
fi
if [ "$what" = quant ]; then
    # Each arm its own process and log (the device tool brings back at most 8 files); short TTFT prompts.
    bench=("$PY" benchmarks/gpu_bench.py --steps 20 --prompt 512)
    step quant-8b-bf16 quant_8b_bf16.log "${bench[@]}" --shape 8b --batch-sizes 64
    step quant-8b-fp8 quant_8b_fp8.log "${bench[@]}" --shape 8b --batch-sizes 64 --quantization fp8
    step quant-kv-bf16 quant_kv_bf16.log "${bench[@]}" --batch-sizes 256 --context 4000
    step quant-kv-fp8 quant_kv_fp8.log "${bench[@]}" --batch-sizes 256 --context 4000 --kv-cache-dtype fp8
fi
exit "$rc"
