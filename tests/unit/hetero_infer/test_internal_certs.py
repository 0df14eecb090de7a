"""`hetero-infer internal-certs`: what it writes verifies (the certificate is the CA's, names every
address dialled, the key is 0600), and a real gRPC server with those files as its mutual-TLS
credentials (hetero_common.grpc_server) accepts a client presenting the certificate and refuses
one without it, or with another run's."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetero_common.config import TLSConfig
from hetero_common.grpc_server import channel_credentials, server_credentials
from hetero_infer.cli import main
from hetero_infer.internal_certs import default_names

WORKER_DNS_HOST = "hetero-worker.hetero.svc.cluster.local"  # deploy/base/config.json's worker_dns


def make(tmp_path: Path, *extra: str) -> Path:
    assert main(["internal-certs", "--out", str(tmp_path), *extra]) == 0
    return tmp_path


def load(directory: Path) -> tuple[x509.Certificate, x509.Certificate, bytes]:
    ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((directory / "tls.crt").read_bytes())
    return ca, cert, (directory / "tls.key").read_bytes()


def sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(i) for i in san.get_values_for_type(x509.IPAddress)]


def check_bundle(ca: x509.Certificate, cert: x509.Certificate, key_pem: bytes) -> None:
    cert.verify_directly_issued_by(ca)  # raises unless the CA signed it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    key = load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # the key is the certificate's
    now = datetime.datetime.now(datetime.timezone.utc)
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc <= ca.not_valid_after_utc
    dns, ips = sans(cert)
    for name in ("localhost", "hetero-scheduler", "hetero-scheduler.hetero.svc.cluster.local", "hetero-worker",
                 WORKER_DNS_HOST, "*.hetero-worker.hetero.svc.cluster.local"):
        assert name in dns, (name, dns)
    assert {"127.0.0.1", "::1"} <= set(ips)


def test_out_writes_a_ca_a_certificate_and_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    out = make(tmp_path / "certs", "--name", "scheduler", "--name", "worker", "--name", "10.0.0.7", "--days", "30")
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]  # no CA key, no temp file
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca.crt").stat().st_mode) == 0o644
    ca, cert, key = load(out)
    check_bundle(ca, cert, key)
    dns, ips = sans(cert)
    assert {"scheduler", "worker"} <= set(dns) and "10.0.0.7" in ips  # --name: a DNS name or an IP address
    assert "PRIVATE KEY" not in (out / "ca.crt").read_text() + (out / "tls.crt").read_text()
    validity = cert.not_valid_after_utc - cert.not_valid_before_utc  # --days 30, the start backdated a little
    assert validity.days == 30


def test_every_run_is_a_new_ca_and_if_missing_keeps_a_complete_set(tmp_path: Path) -> None:
    first = load(make(tmp_path / "a"))
    second = load(make(tmp_path / "b"))
    assert first[0].public_key().public_numbers() != second[0].public_key().public_numbers()
    with pytest.raises(Exception):
        second[1].verify_directly_issued_by(first[0])
    kept = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    make(tmp_path / "a", "--if-missing")
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == kept
    (tmp_path / "a" / "tls.key").unlink()  # an incomplete set is made again, whole
    make(tmp_path / "a", "--if-missing")
    ca, cert, key = load(tmp_path / "a")
    check_bundle(ca, cert, key)
    assert (tmp_path / "a" / "ca.crt").read_bytes() != kept["ca.crt"]
    make(tmp_path / "a")  # without --if-missing: always new
    assert (tmp_path / "a" / "ca.crt").read_bytes() != kept["ca.crt"]
    assert stat.S_IMODE((tmp_path / "a" / "tls.key").stat().st_mode) == 0o600


def test_kubernetes_secret_is_the_secret_the_manifests_mount(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["internal-certs", "--kubernetes-secret"]) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written
    (secret,) = [d for d in yaml.safe_load_all(out) if d]
    assert secret["apiVersion"] == "v1" and secret["kind"] == "Secret" and secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["name"] == "hetero-internal-tls" and secret["metadata"]["namespace"] == "hetero"
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert sorted(files) == ["ca.crt", "tls.crt", "tls.key"]
    check_bundle(x509.load_pem_x509_certificate(files["ca.crt"]), x509.load_pem_x509_certificate(files["tls.crt"]),
                 files["tls.key"])
    assert main(["internal-certs", "--kubernetes-secret", "--namespace", "llm", "--cluster-domain", "corp"]) == 0
    (secret,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert secret["metadata"]["namespace"] == "llm"
    dns, _ = sans(x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"])))
    assert "hetero-worker.llm.svc.corp" in dns and "hetero-scheduler.llm" in dns


def test_out_and_kubernetes_secret_are_one_or_the_other(tmp_path: Path) -> None:
    for argv in (["internal-certs"], ["internal-certs", "--out", str(tmp_path), "--kubernetes-secret"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert main(["internal-certs", "--out", str(tmp_path), "--days", "0"]) == 2


def test_default_names_cover_the_deployment() -> None:
    names = default_names()
    assert len(names) == len(set(names))
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            continue
        pytest.fail(f"{name}: IP addresses are added by make_bundle, not listed as names")


# ----------------------------------------------------------------------------- a real gRPC server


@pytest.fixture()
def served(tmp_path: Path):
    """A gRPC server (grpc.health.v1) with the files as its mutual-TLS credentials, as the scheduler and workers bind."""
    out = make(tmp_path / "certs")
    tls = TLSConfig(cert_file=str(out / "tls.crt"), key_file=str(out / "tls.key"), ca_file=str(out / "ca.crt"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls, mutual=True))
    server.start()
    try:
        yield tls, port
    finally:
        server.stop(None)


def check(address: str, credentials: grpc.ChannelCredentials, server_name: str | None = None) -> int:
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with grpc.secure_channel(address, credentials, options=options) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_a_client_with_the_certificate_is_served(served) -> None:
    tls, port = served
    creds = channel_credentials(tls, mutual=True)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert check(f"localhost:{port}", creds) == serving  # the exec probes: hetero-infer health localhost:PORT
    assert check(f"127.0.0.1:{port}", creds) == serving
    # A replica found through worker_dns: dialled by its IP, checked against the worker_dns name
    # (scheduler_svc/replicas/replica_set.py -> grpc_server.internal_channel(server_name=...)).
    assert check(f"127.0.0.1:{port}", creds, WORKER_DNS_HOST) == serving
    assert check(f"127.0.0.1:{port}", creds, "hetero-worker-1.hetero-worker.hetero.svc.cluster.local") == serving
    assert check(f"127.0.0.1:{port}", creds, "hetero-scheduler") == serving


def test_a_client_without_it_or_with_another_ca_is_refused(served, tmp_path: Path) -> None:
    tls, port = served
    with pytest.raises(grpc.RpcError) as exc:  # trusts the server, presents no certificate
        check(f"localhost:{port}", grpc.ssl_channel_credentials(Path(tls.ca_file).read_bytes()))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    other = make(tmp_path / "other")  # a certificate of another run's CA
    foreign = TLSConfig(cert_file=str(other / "tls.crt"), key_file=str(other / "tls.key"), ca_file=tls.ca_file)
    with pytest.raises(grpc.RpcError) as exc:
        check(f"localhost:{port}", channel_credentials(foreign, mutual=True))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as exc:  # the server's certificate does not name this host
        check(f"127.0.0.1:{port}", channel_credentials(tls, mutual=True), "hetero-gateway.example.com")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext, all kubelet's gRPC probe can do
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
