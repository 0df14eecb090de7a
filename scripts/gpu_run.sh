#!/usr/bin/env bash
# Run on the offline GPU machine from the repository root, after scripts/gpu_carry.sh prepared
# .flashinfer_carry/ (the wheels, and FlashInfer's modules built ahead for sm_90a) and it was copied there
# with the working tree. A device call is scarce (15 minutes a session, a machine that goes back cold after
# 30 s idle), so two prepared calls do everything:
#
#   HETERO_COMMIT=abc1234 bash scripts/gpu_run.sh first    # <= 6 minutes on a fresh H200: the versions, the
#       # prebuilt modules loaded with the JIT off, every GPU test, the 1B-shape decode table at batch 1, 64
#       # and 256 (fused element-wise kernels, CUDA graphs) with its breakdown, and the docs/perf/ rows
#   HETERO_COMMIT=abc1234 bash scripts/gpu_run.sh second   # the 8B shape, the fp8 weight and fp8 KV arms,
#       # multi-LoRA and speculative decoding on a GPU-shaped random model
#
# HETERO_COMMIT names the commit in the rows (the device gets a copy of the tree without .git); unset, git's
# or the carry's is taken. `first` and `second` set FLASHINFER_DISABLE_JIT=1: a module missing from the
# carry fails at once instead of compiling for minutes. The older single steps stay, for a machine with time:
#
#   bash scripts/gpu_run.sh build    # JIT-compile FlashInfer's modules (minutes; needs nvcc)
#   bash scripts/gpu_run.sh tests    # the GPU tests (pytest -m gpu tests/gpu)
#   bash scripts/gpu_run.sh bench [benchmark flags...]   # benchmarks/gpu_bench.py (--breakdown: a graph step's parts)
#   bash scripts/gpu_run.sh stepcost # benchmarks/step_cost.py: the stack's step against the engine's, on the GPU
#                                    # with a 1B-shaped model, then on this host's CPU cores with the tiny one
#   bash scripts/gpu_run.sh quant    # the fp8 weight (8B shape, batch 64) and fp8 KV (1B, batch 256, 4k) arms
#   bash scripts/gpu_run.sh all      # build, tests, bench and the 8B shape's bench in one call
#   bash scripts/gpu_run.sh install  # only the carried wheels (then PYTHONPATH=$(ls -d /tmp/hetero-gpu/site-*):$PWD)
#
# Every step but `install` first checks that a GPU is visible and stops at once without one. The installed
# wheels (with the prebuilt modules in flashinfer's data/aot) and FlashInfer's JIT cache live under
# $HETERO_GPU_STATE (/tmp/hetero-gpu), outside the tree: a later call on the same warm machine reuses them.
# Logs (and the JSON figures) go to $OUT when set (the device tool's output folder, which brings back at most
# 8 files), else bench_results/gpu/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-first}
[ $# -gt 0 ] && shift
case "$what" in first|second|all|build|tests|bench|stepcost|quant|install) ;;
    *) echo "usage: bash scripts/gpu_run.sh [first|second|install|build|tests|bench|stepcost|quant|all] [benchmark flags...]" >&2; exit 2;;
esac
out=${OUT:-bench_results/gpu}
mkdir -p "$out"
state=${HETERO_GPU_STATE:-/tmp/hetero-gpu}
carry=$PWD/.flashinfer_carry
archive=$carry/wheels.tar.xz
prebuilt=$carry/aot.tar.xz

# --- 0. a GPU, before anything that takes time -----------------------------------------------------
if [ "$what" != install ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${gpus:-0}" -eq 0 ] && [ ! -e /dev/nvidia0 ]; then
        echo "gpu_run $what: no NVIDIA GPU is visible here (nvidia-smi lists none and there is no /dev/nvidia0):" \
             "run it on the GPU machine; on this one the GPU tests skip and benchmarks/gpu_bench.py exits 0" >&2
        exit 2
    fi
fi
for file in "$archive" $([ "$what" = first ] || [ "$what" = second ] && echo "$prebuilt"); do
    if [ ! -f "$file" ]; then
        echo "gpu_run $what: $file is missing: run scripts/gpu_carry.sh on a machine with package registries, then" \
             "carry .flashinfer_carry with the working tree" >&2
        exit 2
    fi
done

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
commit=${HETERO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat "$carry/commit" 2>/dev/null || echo unknown)}
{
    echo "gpu_run $what at $(date -u +%FT%TZ), commit $commit"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    echo "nvcc: ${nvcc_path:-NOT FOUND} ($("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no version'))"
    echo "CUDA_HOME=$CUDA_HOME; libcuda stub $CUDA_HOME/lib64/stubs/libcuda.so: $libcuda_note"
    echo "MAX_JOBS=$MAX_JOBS; FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST; JIT cache: $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer ($(find "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" -name '*.so' 2>/dev/null | wc -l) modules built)"
} | tee "$out/gpu_env.txt"
case "$what" in
    first|second)  # the modules come prebuilt: no compiler needed, and none may run
        export FLASHINFER_DISABLE_JIT=1
        echo "FLASHINFER_DISABLE_JIT=1: every FlashInfer module must come from the carry" | tee -a "$out/gpu_env.txt";;
    install) ;;
    *)
        if [ ! -x "$CUDA_HOME/bin/nvcc" ] || [ ! -e "$stub" ]; then
            echo "gpu_run: FlashInfer's JIT needs $CUDA_HOME/bin/nvcc and $stub (it links -lcuda from there); set CUDA_HOME" >&2
            exit 2
        fi;;
esac

# --- 2. the carried wheels, installed once per archive; the prebuilt modules into flashinfer's data/aot --
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
if [ -f "$prebuilt" ]; then
    # FlashInfer loads $site/flashinfer/data/aot/<name>/<name>.so as it is, without compiling or checking an
    # architecture (flashinfer/jit/env.py get_aot_artifacts); scripts/flashinfer_jit.py loaded checks it does.
    aot=$site/flashinfer/data/aot
    stamp=$(sha256sum "$prebuilt" | cut -c1-16)
    if [ "$(cat "$aot/.carry" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$aot" && mkdir -p "$aot" && tar -xJf "$prebuilt" -C "$aot" && echo "$stamp" > "$aot/.carry" || exit 2
    fi
    echo "prebuilt FlashInfer modules: $(find "$aot" -name '*.so' | wc -l) in $aot" | tee -a "$out/gpu_env.txt"
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
[ "$what" = install ] && exit 0

# --- 3. the steps ----------------------------------------------------------------------------------
rc=0
step() {  # step NAME LOG SECONDS COMMAND...: run under a time limit, log, time, and remember a failure
    local name=$1 log=$2 limit=$3 started
    shift 3
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$log"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 124 ] && echo "gpu_run $name: stopped at its limit of $limit s"
    echo "gpu_run $name: rc=$status, $(( $(date +%s) - started )) s"
    [ "$status" -eq 0 ] || rc=$status
}
pytest_gpu=("$PY" -m pytest -q -m gpu -p no:cacheprovider -rs --timeout 120 tests/gpu)
day=$(date -u +%F)
machine=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/NVIDIA //; s/ .*//')
case "$what" in
first)
    step prebuilt gpu_prebuilt.log 120 "$PY" scripts/flashinfer_jit.py loaded
    if [ "$rc" -ne 0 ]; then
        echo "gpu_run first: the carry lacks prebuilt modules (above); rebuild it with scripts/gpu_carry.sh" >&2
        exit "$rc"
    fi
    step tests gpu_tests.log 240 "${pytest_gpu[@]}"
    step bench gpu_bench.log 150 "$PY" benchmarks/gpu_bench.py --batch-sizes 1,64,256 --breakdown --steps 20 \
        --json "$out/gpu_bench.json"
    if [ -f "$out/gpu_bench.json" ]; then
        "$PY" benchmarks/gpu_perf_rows.py "$out/gpu_bench.json" --machine "${machine:-GPU}" --date "$day" \
            --commit "$commit" | tee "$out/perf_rows.md"
    fi;;
second)
    step bench-8b gpu_bench_8b.log 150 "$PY" benchmarks/gpu_bench.py --shape 8b --batch-sizes 1,64 --steps 20 --prompt 512
    step quant-8b-fp8 quant_8b_fp8.log 120 "$PY" benchmarks/gpu_bench.py --steps 20 --prompt 512 --shape 8b \
        --batch-sizes 64 --quantization fp8
    step quant-kv gpu_quant_kv.log 150 bash -c "$PY benchmarks/gpu_bench.py --steps 20 --prompt 512 --batch-sizes 256 \
        --context 4000 && $PY benchmarks/gpu_bench.py --steps 20 --prompt 512 --batch-sizes 256 --context 4000 \
        --kv-cache-dtype fp8"
    # LoRA and speculation on a GPU-shaped random model (1B-like layers, the tiny tokenizer), each engine's pool capped
    model=$state/llama-gpu
    [ -f "$model/config.json" ] || "$PY" -c "import sys, torch; from pathlib import Path
from hetero_infer.bench.harness import make_random_llama
make_random_llama(Path(sys.argv[1]), hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                  max_position_embeddings=4096, dtype=torch.bfloat16)" "$model"
    step lora gpu_lora.log 120 "$PY" benchmarks/lora.py --model "$model" --rounds 2 --max-num-blocks 4096
    step speculative gpu_speculative.log 120 "$PY" benchmarks/speculative.py --model "$model" --rounds 2 \
        --max-num-blocks 4096;;
*)
    if [ "$what" = build ] || [ "$what" = all ]; then
        # FlashInfer's JIT warm-up, timed per module: everything the worker, tests and benchmark select.
        step build gpu_build.log 600 "$PY" scripts/flashinfer_jit.py build
    fi
    if [ "$what" = tests ] || [ "$what" = all ]; then
        step tests gpu_tests.log 600 "${pytest_gpu[@]}"
    fi
    if [ "$what" = bench ] || [ "$what" = all ]; then
        step bench gpu_bench.log 600 "$PY" benchmarks/gpu_bench.py --json "$out/gpu_bench.json" "$@"
    fi
    if [ "$what" = all ]; then  # issue 37's second shape: Llama-3.1-8B's, batch 1 and 64
        step bench-8b gpu_bench_8b.log 600 "$PY" benchmarks/gpu_bench.py --shape 8b --batch-sizes 1,64 --steps 20 \
            --prompt 512 --json "$out/gpu_bench_8b.json"
    fi
    if [ "$what" = stepcost ]; then
        # FlashInfer compiles on first use what the build step did not (the 64-wide heads these models have).
        step stepcost-cuda step_cost_cuda.log 600 "$PY" benchmarks/step_cost.py --device cuda --model llama-1b
        step stepcost-cpu step_cost_cpu.log 600 "$PY" benchmarks/step_cost.py --device cpu
    fi
    if [ "$what" = quant ]; then
        # Each arm its own process and log (the device tool brings back at most 8 files); short TTFT prompts.
        bench=("$PY" benchmarks/gpu_bench.py --steps 20 --prompt 512)
        step quant-8b-bf16 quant_8b_bf16.log 600 "${bench[@]}" --shape 8b --batch-sizes 64
        step quant-8b-fp8 quant_8b_fp8.log 600 "${bench[@]}" --shape 8b --batch-sizes 64 --quantization fp8
        step quant-kv-bf16 quant_kv_bf16.log 600 "${bench[@]}" --batch-sizes 256 --context 4000
        step quant-kv-fp8 quant_kv_fp8.log 600 "${bench[@]}" --batch-sizes 256 --context 4000 --kv-cache-dtype fp8
    fi;;
esac
exit "$rc"
