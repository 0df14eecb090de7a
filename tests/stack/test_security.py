"""API keys, TLS on the public ports and mutual TLS on the internal links, on a real stack."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from hetero_infer.supervisor import wait_healthy
from tests.helpers.certs import Pki, make_pki
from hetero_infer.bench.harness import REPO_ROOT, free_port, stop_process

pytestmark = pytest.mark.slow
KEY, FILE_KEY, WRONG = "sk-test-7f3a9c", "sk-from-file-51d2", "sk-wrong-0000"


class SecureStack:
    def __init__(self, pki: Pki, grpc_port: int, http_port: int, worker_address: str, log_file: Path) -> None:
        self.pki, self.grpc_address, self.http_url = pki, f"127.0.0.1:{grpc_port}", f"https://127.0.0.1:{http_port}"
        self.worker_address, self.log_file = worker_address, log_file

    def channel(self, ca: Path) -> grpc.Channel:
        return grpc.secure_channel(self.grpc_address, grpc.ssl_channel_credentials(ca.read_bytes()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("other-pki"), name="untrusted")


@pytest.fixture(scope="module")
def secure_stack(tiny_llama_dir: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("secure")
    keys_file = work / "keys.txt"
    keys_file.write_text(f"# one key per line\n{FILE_KEY}\n")
    grpc_port, http_port = free_port(), free_port()
    worker_address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--model", str(tiny_llama_dir),
           "--serving-port", str(grpc_port), "--serving-http-port", str(http_port),
           "--scheduler-address", f"127.0.0.1:{free_port()}", "--worker-address", worker_address,
           "--serving-api-keys", KEY, "--serving-api-keys-file", str(keys_file),
           "--serving-tls-cert-file", str(pki.cert_file), "--serving-tls-key-file", str(pki.key_file),
           "--serving-tls-ca-file", str(pki.ca_file),
           "--internal-tls-cert-file", str(pki.cert_file), "--internal-tls-key-file", str(pki.key_file),
           "--internal-tls-ca-file", str(pki.ca_file), "--log-format", "json", "--log-level", "debug"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    log_file = work / "stack.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"127.0.0.1:{grpc_port}", 240, process, grpc.ssl_channel_credentials(pki.ca_file.read_bytes()))
            yield SecureStack(pki, grpc_port, http_port, worker_address, log_file)
        finally:
            stop_process(process)


def _complete(channel: grpc.Channel, key: str | None) -> inference_pb2.GenerateResponse:
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    params = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    return inference_pb2_grpc.InferenceStub(channel).Complete(inference_pb2.GenerateRequest(prompt="the city", params=params),
                                                              metadata=metadata, timeout=60)


def test_grpc_api_keys_over_tls(secure_stack: SecureStack) -> None:
    with secure_stack.channel(secure_stack.pki.ca_file) as channel:
        for key in (None, WRONG):
            with pytest.raises(grpc.RpcError) as denied:
                _complete(channel, key)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _complete(channel, KEY).usage.completion_tokens == 3
        assert _complete(channel, FILE_KEY).usage.completion_tokens == 3
        # streaming RPCs are guarded too
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(prompt="x"), timeout=30)
        with pytest.raises(grpc.RpcError) as denied_stream:
            list(stream)
        assert denied_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health stays open (load balancers, container health checks)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_client_not_trusting_the_ca_is_refused(secure_stack: SecureStack, other_pki: Pki) -> None:
    with secure_stack.channel(other_pki.ca_file) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _complete(channel, KEY)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secure_stack.grpc_address) as plain:
        with pytest.raises(grpc.RpcError):
            _complete(plain, KEY)


def test_http_api_keys_over_tls(secure_stack: SecureStack, other_pki: Pki) -> None:
    body = {"prompt": "the city", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    trusting = ssl.create_default_context(cafile=str(secure_stack.pki.ca_file))
    with httpx.Client(base_url=secure_stack.http_url, verify=trusting, timeout=60) as client:
        missing = client.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {WRONG}"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        ok = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert client.get("/healthz").status_code == 200  # probes stay open
    other_ca = ssl.create_default_context(cafile=str(other_pki.ca_file))
    with httpx.Client(base_url=secure_stack.http_url, verify=other_ca, timeout=10) as untrusting:
        with pytest.raises(httpx.ConnectError):
            untrusting.get("/healthz")


def test_worker_link_requires_a_client_certificate(secure_stack: SecureStack) -> None:
    pki = secure_stack.pki
    no_cert = grpc.ssl_channel_credentials(pki.ca_file.read_bytes())
    with grpc.secure_channel(secure_stack.worker_address, no_cert) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secure_stack.worker_address) as plain:
        with pytest.raises(grpc.RpcError):
            worker_pb2_grpc.WorkerStub(plain).Describe(worker_pb2.DescribeRequest(), timeout=10)
    mutual = grpc.ssl_channel_credentials(pki.ca_file.read_bytes(), pki.key_file.read_bytes(), pki.cert_file.read_bytes())
    with grpc.secure_channel(secure_stack.worker_address, mutual) as channel:
        assert worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10).num_blocks > 0


def test_keys_never_logged(secure_stack: SecureStack) -> None:
    with secure_stack.channel(secure_stack.pki.ca_file) as channel:
        _complete(channel, KEY)
    text = secure_stack.log_file.read_text()
    assert "gateway serving" in text
    assert KEY not in text and FILE_KEY not in text and WRONG not in text
