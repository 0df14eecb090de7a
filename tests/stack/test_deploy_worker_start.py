"""The worker pod's start command and probes, taken from the rendered StatefulSet (deploy/overlays/cpu) and
run here as the container would run it: `/bin/sh -c <script>` with the container's HETERO_*
variables and the rendered config.json. With the tensor-parallel size at 2 it must start both
ranks, which join through torch.distributed (gloo) and answer Describe as one replica of
size 2 on the configured port; SIGTERM to the pod's main process (rank 0, which the script
exec'd) stops both. With deploy/components/internal-mtls, the probe commands it renders pass
against the worker serving mutual TLS. Only the addresses (loopback), the model (the tiny test
model), the thread count and the certificates (a throwaway CA) differ from a pod. No cluster
is involved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import psutil
import pytest

from hetero.v1 import worker_pb2, worker_pb2_grpc
from hetero_common.config import TLSConfig
from hetero_common.grpc_server import channel_credentials
from hetero_infer.bench.harness import free_port
from hetero_infer.supervisor import wait_healthy
from tests.helpers.certs import make_pki
from tests.helpers.k8s_manifests import (
    DEPLOY,
    container,
    env_of,
    find,
    kubectl_binary,
    pending_discovery_keys,
    render,
    variant_dir,
)

pytestmark = pytest.mark.slow


def mounted_internal_tls(worker: dict[str, Any], tmp_path: Path) -> tuple[Callable[[str], str],
                                                                          grpc.ChannelCredentials | None]:
    """When the rendered pod mounts the internal-tls Secret: its files from a throwaway CA, and (a
    function mapping a path under the mount to its local file, the credentials that call the
    worker); else (identity, None)."""
    mount = next((m["mountPath"] for m in worker.get("volumeMounts", []) if m["name"] == "internal-tls"), None)
    if mount is None:
        return (lambda value: value), None
    pki = make_pki(tmp_path / "pki")
    files = tmp_path / "internal-tls"
    files.mkdir()
    for name, source in (("tls.crt", pki.cert_file), ("tls.key", pki.key_file), ("ca.crt", pki.ca_file)):
        shutil.copy(source, files / name)
    credentials = channel_credentials(TLSConfig(str(pki.cert_file), str(pki.key_file), str(pki.ca_file)), mutual=True)
    return (lambda value: value.replace(mount.rstrip("/"), str(files))), credentials


def test_worker_start_command_runs_a_tensor_parallel_replica(tiny_llama_dir: Path, tmp_path: Path) -> None:
    docs = render(kubectl_binary(), DEPLOY / "overlays" / "cpu")
    worker = container(find(docs, "StatefulSet", "hetero-worker"))
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    config = json.loads(find(docs, "ConfigMap", "hetero-config")["data"]["config.json"])
    for key in pending_discovery_keys():  # until b18-discovery is merged, Config does not know these yet
        config.pop(key)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    port = free_port()
    local, credentials = mounted_internal_tls(worker, tmp_path)  # deploy/base includes internal-mtls
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env.update({k: local(v) for k, v in env_of(worker).items()})
    env.update(HETERO_CONFIG=str(config_file), HETERO_TENSOR_PARALLEL_SIZE="2", HETERO_NUM_THREADS="1",
               HETERO_MODEL=str(tiny_llama_dir), HETERO_WORKER_ADDRESS=f"127.0.0.1:{port}",
               HETERO_INTERNAL_BIND_HOST="127.0.0.1", HETERO_DTYPE="float32", HETERO_LOG_LEVEL="warning")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the image's hetero-infer
    pod = subprocess.Popen([*worker["command"], *worker["args"]], env=env, cwd=tmp_path)
    try:
        wait_healthy(f"127.0.0.1:{port}", 180, pod, credentials)
        address = f"127.0.0.1:{port}"
        with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as channel:
            described = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert described.tensor_parallel_size == 2 and described.pid == pod.pid  # rank 0 is the pod's main process
        ranks = [p for p in psutil.Process(pod.pid).children() if "--tp-rank" in p.cmdline()]
        assert [p.cmdline()[p.cmdline().index("--tp-rank") + 1] for p in ranks] == ["1"]
        pod.send_signal(signal.SIGTERM)  # what the kubelet sends
        assert pod.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), "rank 1 outlived rank 0"
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()


def test_internal_mtls_probe_commands_pass_against_a_mutual_tls_worker(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """deploy/components/internal-mtls: the worker started with the component's variables serves
    mutual TLS, the probe commands the component renders (`hetero-infer health localhost:PORT` with
    the mounted files) pass, and a plaintext check, which is all kubelet's gRPC probe can do, fails."""
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    docs = render(kubectl_binary(), variant_dir(root, "cpu", ("internal-mtls",)))
    workload = find(docs, "StatefulSet", "hetero-worker")
    worker = container(workload)
    mount = next(m["mountPath"] for m in worker["volumeMounts"] if m["name"] == "internal-tls")
    pki = make_pki(tmp_path / "pki")
    files = tmp_path / "internal-tls"  # the Secret's files as the pod sees them under `mount`
    files.mkdir()
    for name, source in (("tls.crt", pki.cert_file), ("tls.key", pki.key_file), ("ca.crt", pki.ca_file)):
        shutil.copy(source, files / name)

    def local(value: str) -> str:
        return value.replace(mount.rstrip("/"), str(files))

    config = json.loads(find(docs, "ConfigMap", "hetero-config")["data"]["config.json"])
    for key in pending_discovery_keys():
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env.update({k: local(v) for k, v in env_of(worker).items()})
    assert env["HETERO_INTERNAL_TLS_CERT_FILE"] == str(files / "tls.crt")
    env.update(HETERO_CONFIG=str(tmp_path / "config.json"), HETERO_NUM_THREADS="1", HETERO_MODEL=str(tiny_llama_dir),
               HETERO_WORKER_ADDRESS=f"127.0.0.1:{port}", HETERO_INTERNAL_BIND_HOST="127.0.0.1",
               HETERO_DTYPE="float32", HETERO_LOG_LEVEL="warning")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    pod = subprocess.Popen([*worker["command"], *worker["args"]], env=env, cwd=tmp_path)
    try:
        wait_healthy(f"127.0.0.1:{port}", 180, pod,
                     channel_credentials(TLSConfig(str(pki.cert_file), str(pki.key_file), str(pki.ca_file)), mutual=True))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = [local(a) for a in worker[probe]["exec"]["command"]]
            assert command[2] == f"localhost:{worker['ports'][0]['containerPort']}"
            command[2] = f"localhost:{port}"
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{probe}: {done.stdout}{done.stderr}"
        plaintext = subprocess.run(["hetero-infer", "health", f"127.0.0.1:{port}"], env=env, capture_output=True,
                                   text=True, timeout=60)
        assert plaintext.returncode != 0
    finally:
        pod.terminate()
        try:
            pod.wait(30)
        except subprocess.TimeoutExpired:
            pod.kill()
            pod.wait()
