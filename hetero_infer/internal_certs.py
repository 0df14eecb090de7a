"""`hetero-infer internal-certs`: the certificates of the internal links' mutual TLS, made fresh.

One run makes a new CA and one certificate it signs, usable as server and as client certificate
(extended key usage serverAuth + clientAuth), for every name a service of the stack dials: the
scheduler's and the workers' Kubernetes Services (short, namespaced and fully qualified names),
the worker pods through the headless Service (`*.hetero-worker.<namespace>.svc...`, and the
`worker_dns` name the scheduler checks a replica found by DNS against: grpc_server.internal_channel),
`localhost`, 127.0.0.1 and ::1 (the exec probes), plus any `--name`. The gateway, the scheduler
and the workers all present it and all trust the CA.

The CA's private key is never written: nothing can sign another certificate the services would
trust. Rotating is making a new set and restarting every service with it (docs/deployment.md).

    hetero-infer internal-certs --out DIR             ca.crt, tls.crt, tls.key (0600) in DIR
    hetero-infer internal-certs --kubernetes-secret   the Secret hetero-internal-tls on stdout:
        hetero-infer internal-certs --kubernetes-secret | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAMESPACE = "hetero"
DEFAULT_CLUSTER_DOMAIN = "cluster.local"
SECRET_NAME = "hetero-internal-tls"
# The Services of deploy/base whose addresses are dialled on the internal links.
SERVICES = ("hetero-scheduler", "hetero-worker")
HEADLESS_SERVICE = "hetero-worker"  # the StatefulSet's pods: hetero-worker-N.hetero-worker.<ns>.svc...
FILES = ("ca.crt", "tls.crt", "tls.key")
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class Bundle:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    not_after: datetime.datetime

    def files(self) -> dict[str, bytes]:
        return {"ca.crt": self.ca_pem, "tls.crt": self.cert_pem, "tls.key": self.key_pem}


def default_names(namespace: str = DEFAULT_NAMESPACE, cluster_domain: str = DEFAULT_CLUSTER_DOMAIN) -> list[str]:
    """Every name the stack in deploy/ dials on an internal link, and the probes' localhost."""
    names = ["localhost"]
    for service in SERVICES:
        names += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
                  f"{service}.{namespace}.svc.{cluster_domain}"]
    names += [f"*.{HEADLESS_SERVICE}.{namespace}.svc", f"*.{HEADLESS_SERVICE}.{namespace}.svc.{cluster_domain}"]
    return names


def _split(names: list[str]) -> tuple[list[str], list[str]]:
    """DNS names and IP addresses, each once, in the order given."""
    dns: list[str] = []
    ips: list[str] = []
    for name in names:
        name = name.strip()
        if not name:
            continue
        try:
            ip = str(ipaddress.ip_address(name.strip("[]")))
        except ValueError:
            if name not in dns:
                dns.append(name)
        else:
            if ip not in ips:
                ips.append(ip)
    return dns, ips


def make_bundle(names: list[str], days: int = DEFAULT_DAYS) -> Bundle:
    """A new CA (P-256) and a certificate it signs for `names` (DNS names or IP addresses) plus
    127.0.0.1 and ::1, valid for `days`. The CA's key is dropped here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError("days must be >= 1")
    dns, ips = _split([*names, "127.0.0.1", "::1"])
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hetero-infer"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def usage(**on: bool) -> x509.KeyUsage:
        flags = dict.fromkeys(("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                               "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"), False)
        return x509.KeyUsage(**{**flags, **on})

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = name(f"hetero-infer internal CA {now:%Y-%m-%d %H:%M:%S}")
    ca = (x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(not_before).not_valid_after(not_after)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = [*(x509.DNSName(n) for n in dns), *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)]
    cert = (x509.CertificateBuilder().subject_name(name("hetero-infer internal")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return Bundle(ca.public_bytes(serialization.Encoding.PEM), cert.public_bytes(serialization.Encoding.PEM), key_pem,
                  tuple(dns), tuple(ips), not_after)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Written whole under a temporary name, then renamed: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # an existing file keeps its mode through O_CREAT: set it
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_files(bundle: Bundle, out: Path) -> list[Path]:
    """ca.crt and tls.crt (0644), tls.key (0600) in `out` (made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, data in bundle.files().items():
        path = out / file_name
        _write(path, data, 0o600 if file_name == "tls.key" else 0o644)
        written.append(path)
    return written


def secret_manifest(bundle: Bundle, namespace: str = DEFAULT_NAMESPACE, name: str = SECRET_NAME) -> str:
    """A kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (what deploy/components/internal-mtls
    mounts), as YAML for `kubectl apply -f -`."""
    lines = ["apiVersion: v1", "kind: Secret", "metadata:", f"  name: {name}", f"  namespace: {namespace}",
             "  labels:", "    app.kubernetes.io/part-of: hetero-infer", "  annotations:",
             f"    hetero-infer/not-after: \"{bundle.not_after:%Y-%m-%dT%H:%M:%SZ}\"", "type: kubernetes.io/tls", "data:"]
    for file_name, data in bundle.files().items():
        lines.append(f"  {file_name}: {base64.b64encode(data).decode('ascii')}")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="write ca.crt, tls.crt and tls.key (0600) into this directory")
    where.add_argument("--kubernetes-secret", action="store_true",
                       help=f"print the Secret {SECRET_NAME} (YAML) instead: ... --kubernetes-secret | kubectl apply -f -")
    parser.add_argument("--name", action="append", default=[], metavar="NAME",
                        help="a further DNS name or IP address the certificate names (repeatable), e.g. the "
                             "compose services `scheduler` and `worker`")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                        help=f"the Kubernetes namespace of the Services and the Secret (default {DEFAULT_NAMESPACE})")
    parser.add_argument("--cluster-domain", default=DEFAULT_CLUSTER_DOMAIN,
                        help=f"the cluster's DNS domain (default {DEFAULT_CLUSTER_DOMAIN})")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    parser.add_argument("--if-missing", action="store_true",
                        help="with --out: keep the files when all three are there already (a compose init step that "
                             "runs at every `up` must not hand restarted services a CA the others do not trust)")
    parser.add_argument("--secret-name", default=SECRET_NAME, help=f"with --kubernetes-secret (default {SECRET_NAME})")


def run(args: argparse.Namespace) -> int:
    if args.days < 1:
        print("hetero-infer internal-certs: --days must be >= 1", file=sys.stderr)
        return 2
    if args.if_missing and args.out is not None and all((args.out / f).is_file() for f in FILES):
        print(f"hetero-infer internal-certs: {args.out} already holds {', '.join(FILES)}; kept them", file=sys.stderr)
        return 0
    bundle = make_bundle([*default_names(args.namespace, args.cluster_domain), *args.name], args.days)
    if args.kubernetes_secret:
        sys.stdout.write(secret_manifest(bundle, args.namespace, args.secret_name))
        where = f"Secret {args.namespace}/{args.secret_name} (stdout)"
    else:
        write_files(bundle, args.out)
        where = str(args.out)
    print(f"hetero-infer internal-certs: a new CA and certificate in {where}, valid until "
          f"{bundle.not_after:%Y-%m-%d}, for {', '.join([*bundle.dns_names, *bundle.ip_addresses])}", file=sys.stderr)
    return 0
