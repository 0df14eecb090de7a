"""Clients outside the server's own code against a real stack: the Node.js example (npm
packages installed here, from the registry) and `hetero-infer bench` over gRPC and HTTP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import REPO_ROOT, Stack, run_stack

pytestmark = pytest.mark.slow
NODE_EXAMPLE = REPO_ROOT / "examples" / "node_client"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "8", "--max-model-len", "256") as s:
        yield s


@pytest.fixture(scope="module")
def node_example() -> Path:
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.fail("node and npm are needed for the Node.js client test (they are on the CI machines)")
    # `npm ci` installs exactly the versions in package-lock.json into the (git-ignored) node_modules.
    installed = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel", "error"], cwd=NODE_EXAMPLE,
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    return NODE_EXAMPLE


def test_node_client_streams_a_generation(stack: Stack, node_example: Path) -> None:
    params = common_pb2.SamplingParams(max_tokens=12, temperature=0.0)
    reference = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="the river and the city", params=params))
    assert reference.text
    run = subprocess.run(["node", "stream.js", "the river and the city", "--raw", "--max-tokens", "12",
                          "--address", stack.address], cwd=node_example, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == reference.text
    assert "finish_reason=FINISH_REASON_" in run.stderr and "completion_tokens=" in run.stderr


def test_node_client_makes_a_constrained_call(stack: Stack, node_example: Path) -> None:
    """--json-schema: SamplingParams.json_schema from Node; the answer is JSON valid against it."""
    schema = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    params = common_pb2.SamplingParams(max_tokens=24, temperature=0.0, json_schema=json.dumps(schema))
    reference = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="the river and the city", params=params))
    run = subprocess.run(["node", "stream.js", "the river and the city", "--raw", "--max-tokens", "24",
                          "--json-schema", json.dumps(schema), "--address", stack.address],
                         cwd=node_example, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == reference.text and "finish_reason=FINISH_REASON_STOP" in run.stderr
    jsonschema.validate(json.loads(run.stdout), schema)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bench_writes_table_json_and_png(stack: Stack, protocol: str, tmp_path: Path) -> None:
    target = stack.address if protocol == "grpc" else stack.http_url
    run = subprocess.run([sys.executable, "-m", "hetero_infer.cli", "bench", "--protocol", protocol, "--target", target,
                          "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--request-rate", "20",
                          "--max-concurrency", "4", "--output-dir", str(tmp_path), "--no-progress"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for line in ("TTFT", "TPOT", "ITL", "E2E", "req/s"):
        assert line in run.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["requests"] == {"completed": 6, "failed": 0, "errors": []}
    expected = sum(r["output_tokens"] for r in result["per_request"])
    assert result["tokens"]["output"] == expected >= 6 * 2  # ignore_eos: every request makes its max_tokens (2..8)
    assert all(result["latency_ms"][k]["p50"] is not None for k in ("ttft", "tpot", "itl", "e2e"))
    assert result["throughput"]["output_tokens_per_s"] > 0
    png = (tmp_path / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
