"""The seed README's command lines, run as written (subprocesses), and its config files served:
`--input` on the default model (SmolLM2), the seed's config.json with a model its simple
tokenizer matches (a tiny byte-level Llama, named by HETERO_MODEL so the line stays as written),
`--serve` with that config, and the seed's command bridge behind the simple tokenizer (abortable)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import psutil
import pytest

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_infer.supervisor import wait_healthy
from tests.helpers.seed_forms import SEED_BRIDGE_CONFIG, SEED_CONFIG, write_config
from hetero_infer.bench.harness import REPO_ROOT, free_port, stop_process
from tests.helpers.tiny_models import make_tiny_byte_llama

pytestmark = pytest.mark.slow


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    return {**env, "PYTHONPATH": str(REPO_ROOT), "HETERO_LOG_LEVEL": "warning", **extra}


def hetero_infer(*argv: str, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`hetero-infer ARGV` (this checkout's, through python -m)."""
    return subprocess.run([sys.executable, "-m", "hetero_infer.cli", *argv], cwd=cwd, env=env or base_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_byte_llama(tmp_path_factory.mktemp("byte-llama"), seed=3)


@pytest.mark.parametrize("argv", [
    ["--input", "Hello, world!", "--max-tokens", "50"],
    ["--input", "Explain quantum computing", "--max-tokens", "100", "--temperature", "0.8", "--top-p", "0.95"],
])
def test_readme_generate_lines_on_the_default_model(argv: list[str]) -> None:
    result = hetero_infer(*argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()


def test_seed_config_and_input_with_a_model_the_simple_tokenizer_matches(tmp_path: Path, byte_llama: Path) -> None:
    write_config(tmp_path, SEED_CONFIG)
    result = hetero_infer("--config", "config.json", "--input", "Hello", cwd=tmp_path,
                          env=base_env(HETERO_MODEL=str(byte_llama), HETERO_DTYPE="float32"))
    assert result.returncode == 0, result.stderr[-2000:]
    # A random model: its bytes need not be UTF-8, but they are decoded (invalid ones as U+FFFD) and printed.
    assert result.stdout.endswith("\n")


@contextmanager
def serving(argv: list[str], cwd: Path, **env: str) -> Iterator[tuple[grpc.Channel, int]]:
    port, http_port = free_port(), free_port()
    process = subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", *argv], cwd=cwd, env=base_env(
        HETERO_SERVING_PORT=str(port), HETERO_SERVING_HTTP_PORT=str(http_port), HETERO_LOG_FORMAT="json",
        HETERO_SCHEDULER_ADDRESS=f"127.0.0.1:{free_port()}", HETERO_WORKER_ADDRESS=f"127.0.0.1:{free_port()}", **env))
    try:
        wait_healthy(f"127.0.0.1:{port}", 180, process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, http_port
    finally:
        stop_process(process)


def test_seed_serve_line_with_the_seed_config(tmp_path: Path, byte_llama: Path) -> None:
    """`hetero-infer --serve` with the seed's config.json (ports moved by environment, so tests never clash)."""
    write_config(tmp_path, SEED_CONFIG)
    with serving(["--serve", "--config", "config.json"], tmp_path, HETERO_MODEL=str(byte_llama),
                 HETERO_DTYPE="float32") as (channel, http_port):
        stub = inference_pb2_grpc.InferenceStub(channel)
        tokens = stub.Tokenize(inference_pb2.TokenizeRequest(text="Hi é"), timeout=30)
        assert list(tokens.token_ids) == [257, 72, 105, 32, 0xC3, 0xA9]
        params = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        answer = stub.Complete(inference_pb2.GenerateRequest(prompt="Hello", params=params), timeout=60)
        assert len(answer.token_ids) == 12 and all(0 <= t < 259 for t in answer.token_ids)
        assert answer.usage.prompt_tokens == 6 and answer.model == "hetero-infer"
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                       json={"model": "hetero-infer", "prompt": "Hello", "max_tokens": 12, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == answer.text


def test_seed_serve_line_with_the_default_model_fails_naming_tokenizer_kind(tmp_path: Path) -> None:
    write_config(tmp_path, SEED_CONFIG)
    result = hetero_infer("--serve", "--config", "config.json", cwd=tmp_path)
    assert result.returncode == 1 and "tokenizer.kind simple" in result.stderr and "49152" in result.stderr


def test_seed_config_and_input_through_the_command_bridge(tmp_path: Path) -> None:
    """`hetero-infer --config config.json --input Hello` with the seed's config and its bridge backend: the
    program answers and no model is loaded (HETERO_MODEL names no file: loading one would fail)."""
    write_config(tmp_path, {**SEED_CONFIG, "serving": {**SEED_CONFIG["serving"], **SEED_BRIDGE_CONFIG["serving"]}})
    result = hetero_infer("--config", "config.json", "--input", "Hello", cwd=tmp_path,
                          env=base_env(HETERO_MODEL=str(tmp_path / "no-such-model")))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "bridge:Hello\n"


def test_enable_metrics_serves_metrics_on_their_own_port(tmp_path: Path) -> None:
    """The guide's monitoring keys: /metrics on metrics_port alone (the HTTP API's /metrics stays); other paths
    404, other methods 405. A bridge-only gateway: no model needed."""
    write_config(tmp_path, {**SEED_BRIDGE_CONFIG, "tokenizer": {"kind": "simple", "path": None}})
    metrics_port = free_port()
    with serving(["gateway", "--config", "config.json"], tmp_path, HETERO_ENABLE_METRICS="true",
                 HETERO_METRICS_PORT=str(metrics_port)) as (channel, http_port):
        inference_pb2_grpc.InferenceStub(channel).Complete(inference_pb2.GenerateRequest(prompt="hi"), timeout=30)
        own = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert own.status_code == 200 and own.headers["content-type"].startswith("text/plain")
        assert "hetero_prompt_tokens_total 3.0" in own.text  # BOS + "hi"
        assert httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).status_code == 200
        missing = httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", timeout=10)
        assert missing.status_code == 404 and "metrics_port" in missing.json()["error"]["message"]
        assert httpx.post(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).status_code == 405


def test_seed_command_bridge_with_the_simple_tokenizer_and_abort(tmp_path: Path) -> None:
    data = {**SEED_BRIDGE_CONFIG, "tokenizer": {"kind": "simple", "path": None}}
    write_config(tmp_path, data)
    with serving(["gateway", "--config", "config.json"], tmp_path) as (channel, _):
        stub = inference_pb2_grpc.InferenceStub(channel)
        answer = stub.Complete(inference_pb2.GenerateRequest(prompt="hi 東京"), timeout=30)
        assert answer.text == "bridge:hi 東京" and answer.backend == "command_bridge"
        assert answer.usage.prompt_tokens == 1 + len("hi 東京".encode())  # BOS + bytes
        assert answer.usage.completion_tokens == len("bridge:hi 東京".encode())
    # A program that takes its time: Abort by id from another connection kills it; the stream ends with ABORT.
    # (`exec`: the program itself sleeps. A grandchild holding stdout open would outlive the kill, as it
    # outlives a command_timeout_s kill: the bridge reads stdout to its end.) It would sleep 600 s, ten
    # times the stream's deadline: a stream ended with ABORT, and the program gone, is the kill's doing.
    slow = {"serving": {"backend": {"kind": "command_bridge", "command": {
        "program": "/bin/sh", "args": ["-c", "printf 'started'; exec sleep 600"]}}},
        "tokenizer": {"kind": "simple", "path": None}}
    write_config(tmp_path, slow)
    with serving(["gateway", "--config", "config.json"], tmp_path) as (channel, _):
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(prompt="x", request_id="bridge-1"), timeout=60)
        assert next(call).text == "started"
        program = bridge_program(["sleep", "600"])
        with grpc.insecure_channel(channel._channel.target().decode()) as other:
            answer = inference_pb2_grpc.InferenceStub(other).Abort(
                inference_pb2.AbortGenerationRequest(request_ids=["bridge-1", "bridge-2"]), timeout=10)
        assert list(answer.aborted) == ["bridge-1"] and list(answer.not_found) == ["bridge-2"]
        rest = list(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        _, alive = psutil.wait_procs([program], timeout=30)  # a hang guard: killed already, reaped by now
        assert not alive, "the aborted request's program still runs"


def bridge_program(cmdline: list[str]) -> psutil.Process:
    """The bridge's program, a descendant of this test's process (the gateway's child), once it runs `cmdline`."""
    deadline = time.monotonic() + 30  # a hang guard: it printed before it exec'd
    while time.monotonic() < deadline:
        found = [p for p in psutil.Process().children(recursive=True) if _cmdline(p) == cmdline]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no process runs {cmdline}")


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # gone meanwhile
        return []
