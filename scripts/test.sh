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
# promtool (Debian's prometheus package) lints the gateway's metrics page
# (tests/unit/gateway/test_metrics_lint.py, which fails without it when CI is set). Quiet when it
# works; the whole apt log and a non-zero exit when it does not.
install_promtool() {
  local as_root="" apt_log
  if [ "$(id -u)" -ne 0 ]; then as_root="sudo -n"; fi  # -n: fail rather than wait for a password
  apt_log=$(mktemp)
  if ! { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends prometheus; } >"$apt_log" 2>&1 \
     || ! command -v promtool >/dev/null; then
    echo "scripts/test.sh: installing promtool (apt-get install prometheus) failed:" >&2
    cat "$apt_log" >&2
    rm -f "$apt_log"
    exit 1
  fi
  rm -f "$apt_log"
}
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null; then
  install_promtool
fi
python -m hetero_infer.protogen --check
python -m pytest -q -m "not slow" "$@"
python -m pytest -q -m slow --durations=10 "$@"
