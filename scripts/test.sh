#!/usr/bin/env bash
# Set up (test dependencies included) and run the whole suite: fast tests first, then the
# slow real-model and multi-process ones. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
# FlashInfer for the slow compile check (tests/gpu/test_flashinfer_compile.py: every module the worker
# selects, compiled for sm_90a up to the object files).
PY=python bash scripts/flashinfer_host.sh
python -m hetero_infer.protogen --check
python -m pytest -q -m "not slow" "$@"
python -m pytest -q -m slow --durations=10 "$@"
