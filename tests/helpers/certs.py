"""Throwaway PKI for tests: a CA and a certificate it signs for 127.0.0.1 / localhost."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pki:
    ca_file: Path
    cert_file: Path  # for 127.0.0.1 and localhost, usable as server and as client certificate
    key_file: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_pki(directory: Path, name: str = "test", dns_names: tuple[str, ...] = (),
             ip_addresses: tuple[str, ...] = ()) -> Pki:
    """`dns_names`, `ip_addresses`: more names and addresses the certificate carries (besides
    localhost and 127.0.0.1), e.g. the hosts' addresses of a multi-host test."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{name} CA")).issuer_name(_name(f"{name} CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([*(x509.DNSName(n) for n in dns_names), x509.DNSName("localhost"),
                                                        *(x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pki = Pki(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pki.key_file)
    return pki
