"""check_internal_bind: which listen addresses count as loopback, and what is refused."""

from __future__ import annotations

import pytest

from hetero_common.config import Config, TLSConfig
from hetero_common.grpc_server import check_internal_bind, is_loopback_host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.12", "127.255.0.1", "::1", "[::1]", "localhost", "LocalHost"])
def test_loopback(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "10.0.0.5", "192.168.1.2", "fe80::1", "worker-0",
                                  "localhost.example.com", "128.0.0.1"])
def test_not_loopback(host: str) -> None:
    assert not is_loopback_host(host)


@pytest.mark.parametrize("address", ["127.0.0.1:50052", "[::1]:50052", "localhost:50052", "unix:/tmp/s.sock"])
def test_loopback_plaintext_is_allowed(address: str) -> None:
    check_internal_bind(Config(), address, "scheduler")


@pytest.mark.parametrize("address", ["0.0.0.0:50052", "[::]:50052", ":50052", "10.0.0.5:50052", "worker-0:50053"])
def test_plaintext_off_loopback_is_refused_naming_the_keys(address: str) -> None:
    with pytest.raises(SystemExit) as refused:
        check_internal_bind(Config(), address, "worker")
    message = str(refused.value)
    assert message.startswith(f"worker: refusing to listen on {address} in plaintext")
    assert "internal_tls.cert_file, key_file and ca_file" in message and "allow_insecure_internal: true" in message


def test_tls_or_the_opt_out_allows_it() -> None:
    check_internal_bind(Config(internal_tls=TLSConfig("c.pem", "k.pem", "ca.pem")), "0.0.0.0:50052", "scheduler")
    check_internal_bind(Config(allow_insecure_internal=True), "0.0.0.0:50052", "scheduler")  # with a warning
