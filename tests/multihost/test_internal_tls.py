"""The stack across hosts with the shipped internal TLS settings: gateway, scheduler and worker each
in its own network namespace, the internal links (gateway -> scheduler -> worker) mutual TLS
(internal_tls.cert_file, key_file, ca_file, made by `hetero-infer internal-certs`; no
allow_insecure_internal), the worker listening on 0.0.0.0 and the scheduler on its host's address. The stack serves; from a fourth host (the
"intruder"), a client without the CA's certificate can call neither the scheduler nor the worker:
not in plaintext, not over TLS that trusts the CA but presents no certificate, not with a
certificate from another CA (the same host with the stack's certificate can, so the refusals are
the certificates' doing, not the network's); and the stack still serves after the attempts.
Skipped only where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_common.config import TLSConfig
from hetero_common.grpc_server import channel_credentials
from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.certs import Pki, make_pki
from tests.helpers.multihost_stack import (
    GATEWAY_PORT,
    HTTP_PORT,
    SCHEDULER_PORT,
    WORKER_PORT,
    Front,
    start_service,
    wait_ready,
)
from tests.helpers.netns import Network, network  # noqa: F401  (a fixture)
from tests.helpers.oracle import NEW_TOKENS, engine_greedy, make_prompts
from tests.helpers.stack_requests import ids_request

pytestmark = pytest.mark.slow

# Run on the intruder's host: every client against both services; prints {"<call> / <client>": "OK" | "CODE: details"}.
PROBE = r"""
import json, sys
import grpc
from hetero.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

scheduler, worker, ca, cert, key, other_cert, other_key = sys.argv[1:8]
read = lambda path: open(path, "rb").read()
clients = {
    "plaintext": None,
    "TLS without a client certificate": grpc.ssl_channel_credentials(read(ca)),
    "a client certificate of another CA": grpc.ssl_channel_credentials(read(ca), read(other_key), read(other_cert)),
    "the stack's certificate": grpc.ssl_channel_credentials(read(ca), read(key), read(cert)),
}
calls = {
    "Scheduler/GetStats": (scheduler, lambda c: scheduler_pb2_grpc.SchedulerStub(c).GetStats(
        scheduler_pb2.GetStatsRequest(), timeout=10)),
    "Worker/Describe": (worker, lambda c: worker_pb2_grpc.WorkerStub(c).Describe(worker_pb2.DescribeRequest(), timeout=10)),
}
results = {}
for client, creds in clients.items():
    for call, (address, rpc) in calls.items():
        channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        try:
            rpc(channel)
            results[f"{call} / {client}"] = "OK"
        except grpc.RpcError as exc:
            results[f"{call} / {client}"] = f"{exc.code().name}: {exc.details()}"
        finally:
            channel.close()
print(json.dumps(results))
"""


def tls_flags(pki: Pki) -> list[str]:
    return ["--internal-tls-cert-file", str(pki.cert_file), "--internal-tls-key-file", str(pki.key_file),
            "--internal-tls-ca-file", str(pki.ca_file)]


def shipped_certificates(out: Path, *addresses: str) -> Pki:
    """The stack's certificates as an operator makes them: `hetero-infer internal-certs` (the command the
    deployment docs give), naming the hosts' addresses as the deployment names its services."""
    names = [arg for address in addresses for arg in ("--name", address)]
    subprocess.run([sys.executable, "-m", "hetero_infer.cli", "internal-certs", "--out", str(out), *names],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=60)
    return Pki(out / "ca.crt", out / "tls.crt", out / "tls.key")


def test_mutual_tls_across_hosts_serves_and_refuses_clients_without_the_cas_certificate(
        network: Network, tiny_llama_dir: Path, tmp_path: Path) -> None:
    gateway, scheduler, worker, intruder = (network.add_host(n) for n in ("gateway", "scheduler", "worker", "intruder"))
    pki = shipped_certificates(tmp_path / "pki", scheduler.address, worker.address)
    other = make_pki(tmp_path / "other", name="other", ip_addresses=(intruder.address,))
    creds = channel_credentials(TLSConfig(str(pki.cert_file), str(pki.key_file), str(pki.ca_file)), mutual=True)
    tls = tls_flags(pki)
    worker_address, scheduler_address = f"{worker.address}:{WORKER_PORT}", f"{scheduler.address}:{SCHEDULER_PORT}"
    front = Front(f"{gateway.address}:{GATEWAY_PORT}", scheduler_address, internal_credentials=creds)

    w = start_service(worker, "worker", tiny_llama_dir, "--worker-address", worker_address,
                      "--internal-bind-host", "0.0.0.0", *tls, insecure_internal=False)
    wait_ready(worker_address, w, credentials=creds)
    s = start_service(scheduler, "scheduler", tiny_llama_dir, "--scheduler-address", scheduler_address,
                      "--worker-addresses", worker_address, *tls, insecure_internal=False)
    wait_ready(scheduler_address, s, credentials=creds)
    g = start_service(gateway, "gateway", tiny_llama_dir, "--scheduler-address", scheduler_address, *tls,
                      "--serving-host", gateway.address, "--serving-port", str(GATEWAY_PORT),
                      "--serving-http-port", str(HTTP_PORT))
    wait_ready(front.gateway, g)

    prompt = make_prompts()[6]
    expected = engine_greedy(tiny_llama_dir, [prompt])[0]

    def serves() -> None:
        assert [t for m in front.generate(ids_request(prompt, NEW_TOKENS)) for t in m.token_ids] == expected
        assert [r.up for r in front.stats().replicas] == [True]

    serves()

    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    probe = intruder.popen([sys.executable, "-c", PROBE, scheduler_address, worker_address, str(pki.ca_file),
                            str(pki.cert_file), str(pki.key_file), str(other.cert_file), str(other.key_file)],
                           cwd=REPO_ROOT, env=env, stdout=-1)
    out, _ = probe.communicate(timeout=120)
    assert probe.returncode == 0
    results = json.loads(out)
    print("\nfrom the intruder's host:\n" + "\n".join(f"  {call}: {result}" for call, result in results.items()))
    for call in ("Scheduler/GetStats", "Worker/Describe"):
        assert results[f"{call} / the stack's certificate"] == "OK"  # the host reaches both services
        for client in ("plaintext", "TLS without a client certificate", "a client certificate of another CA"):
            assert results[f"{call} / {client}"].startswith("UNAVAILABLE"), (call, client, results[f"{call} / {client}"])

    assert all(p.poll() is None for p in (w, s, g))
    serves()  # the attempts left the stack serving
