#!/usr/bin/env bash
# Set up, start the three-process stack serving SmolLM2-135M-Instruct, send a demo request.
# Usage: bash scripts/demo.sh [--exit] [extra `hetero-infer serve` flags]
#   --exit   stop the stack after the demo request instead of serving on (Ctrl-C stops it)
set -euo pipefail
cd "$(dirname "$0")/.."
exit_after=0
if [ "${1:-}" = "--exit" ]; then exit_after=1; shift; fi
bash scripts/setup.sh
. .venv/bin/activate
port=${HETERO_SERVING_PORT:-50051}
hetero-infer serve --serving-port "$port" "$@" &
stack=$!
trap 'kill -TERM $stack 2>/dev/null; wait $stack 2>/dev/null' EXIT
python - "$port" <<'PY'
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address = f"127.0.0.1:{sys.argv[1]}"
deadline = time.time() + 300
with grpc.insecure_channel(address) as channel:
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            if time.time() > deadline:
                sys.exit(f"the stack did not become ready at {address}")
        time.sleep(0.5)
PY
echo "--- demo request (chat): What is the capital of France?"
python examples/python_client.py --address "127.0.0.1:$port" "What is the capital of France?"
if [ "$exit_after" = 1 ]; then exit 0; fi
echo "--- serving on 127.0.0.1:$port (Ctrl-C to stop)"
wait $stack
