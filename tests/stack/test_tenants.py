"""Tenants and roles on the real stack (issue 58, Done means 1): two inference keys, A and B, and an
admin key. B cannot abort, re-attach to or learn of A's request, even with the same request id,
prompt and parameters; an admin can abort any; only the admin key loads, replaces or unloads a
LoRA adapter or sees its path; an adapter path outside `lora_root`, or a symlink out of it, is
refused; the key is checked before an HTTP body is read. Then start-up failing closed: no keys on
0.0.0.0, and a keys file with no key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_common.tenancy import key_label
from hetero_infer.bench.harness import REPO_ROOT, Stack, free_port, run_stack
from tests.helpers.raw_http import read_response
from tests.helpers.tiny_models import make_lora_adapter

pytestmark = pytest.mark.slow
KEY_A, KEY_B, ADMIN = "sk-tenant-a-51c9", "sk-tenant-b-07de", "sk-admin-93fa"
LONG = 3000  # tokens: still running while the test acts (long_context_llama_dir: 400 tokens take about a second)


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def long_request(request_id: str) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=inference_pb2.TokenIds(ids=[5, 6, 7, 8]),
                                         params=common_pb2.SamplingParams(max_tokens=LONG, temperature=0.0,
                                                                          ignore_eos=True))


def pool(stack: Stack) -> common_pb2.PoolStats:
    return stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest(), metadata=auth(ADMIN), timeout=10).pool


def wait_running(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 60
    while pool(stack).num_running != count:
        assert time.monotonic() < deadline, f"{pool(stack).num_running} running, expected {count}"
        time.sleep(0.05)


def abort(stack: Stack, key: str, request_id: str) -> inference_pb2.AbortGenerationResponse:
    return stack.inference.Abort(inference_pb2.AbortGenerationRequest(request_ids=[request_id]), metadata=auth(key),
                                 timeout=30)


def last_finish(stream: Iterator[inference_pb2.GenerateResponse]) -> int:
    reason = common_pb2.FINISH_REASON_UNSPECIFIED
    for message in stream:
        reason = message.finish_reason or reason
    return reason


@pytest.fixture(scope="module")
def loras(long_context_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("tenant-loras")
    root = work / "root"
    made = {"inside": make_lora_adapter(long_context_llama_dir, root / "inside", 8, ["q_proj", "v_proj"], seed=1),
            "outside": make_lora_adapter(long_context_llama_dir, work / "outside", 8, ["q_proj"], seed=2)}
    (root / "escape").symlink_to(made["outside"], target_is_directory=True)  # a symlink in the root, pointing out
    made["escape"], made["root"] = root / "escape", root
    made["dotdot"] = root / ".." / "outside"
    return made


@pytest.fixture(scope="module")
def stack(long_context_llama_dir: Path, loras: dict[str, Path]) -> Iterator[Stack]:
    with run_stack(long_context_llama_dir, "--max-model-len", "4096", "--max-num-seqs", "4", "--max-lora-rank", "16",
                   "--serving-api-keys", f"{KEY_A},{KEY_B}", "--serving-admin-api-keys", ADMIN,
                   "--lora-root", str(loras["root"]), "--log-level", "warning") as s:
        yield s


def test_b_cannot_abort_reattach_to_or_learn_of_as_request(stack: Stack) -> None:
    api = stack.inference
    a_stream = api.Generate(long_request("shared-1"), metadata=auth(KEY_A), timeout=300)
    assert next(a_stream).token_ids
    # B aborting A's id finds nothing, and says nothing of A's request.
    answer = abort(stack, KEY_B, "shared-1")
    assert list(answer.not_found) == ["shared-1"] and not answer.aborted
    # B sending the same id, prompt and parameters gets a request of its own (no ALREADY_EXISTS, no re-attach).
    b_stream = api.Generate(long_request("shared-1"), metadata=auth(KEY_B), timeout=300)
    first_b = next(b_stream)
    assert first_b.request_id == "shared-1" and first_b.token_ids
    wait_running(stack, 2)
    # A ends its own request; B's runs on.
    assert list(abort(stack, KEY_A, "shared-1").aborted) == ["shared-1"]
    assert last_finish(a_stream) == common_pb2.FINISH_REASON_ABORT
    assert not next(b_stream).finish_reason
    wait_running(stack, 1)
    # The admin key ends any tenant's request of that id.
    assert list(abort(stack, ADMIN, "shared-1").aborted) == ["shared-1"]
    assert last_finish(b_stream) == common_pb2.FINISH_REASON_ABORT
    wait_running(stack, 0)
    assert pool(stack).used_blocks == 0


def test_a_keyed_client_going_away_ends_its_request(stack: Stack) -> None:
    """The key's wrapper around the stream (auth._as) closes the handler's when the client leaves."""
    stream = stack.inference.Generate(long_request("gone-1"), metadata=auth(KEY_A), timeout=300)
    assert next(stream).token_ids
    wait_running(stack, 1)
    stream.cancel()
    wait_running(stack, 0)
    assert pool(stack).used_blocks == 0


def test_metrics_name_tenants_by_label_never_by_key(stack: Stack) -> None:
    params = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    stack.inference.Complete(inference_pb2.GenerateRequest(prompt="hello", params=params), metadata=auth(KEY_B),
                             timeout=60)
    page = httpx.get(f"http://127.0.0.1:{stack.http_port}/metrics", headers={"authorization": f"Bearer {ADMIN}"},
                     timeout=10).text
    assert f'hetero_tenant_requests_total{{tenant="{key_label(KEY_B)}"}}' in page
    assert all(key not in page for key in (KEY_A, KEY_B, ADMIN))


def test_only_an_admin_loads_replaces_unloads_or_sees_paths(stack: Stack, loras: dict[str, Path]) -> None:
    api, url = stack.inference, f"http://127.0.0.1:{stack.http_port}"
    load = common_pb2.LoadLoraAdapterRequest(name="team-a", path=str(loras["inside"]))
    for call, request in ((api.LoadLoraAdapter, load),
                          (api.UnloadLoraAdapter, common_pb2.UnloadLoraAdapterRequest(name="team-a"))):
        with pytest.raises(grpc.RpcError) as info:
            call(request, metadata=auth(KEY_A), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin" in info.value.details()
    http_load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "team-a", "lora_path": str(loras["inside"])},
                           headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert http_load.status_code == 403 and "admin" in http_load.json()["error"]["message"]

    loaded = api.LoadLoraAdapter(load, metadata=auth(ADMIN), timeout=60)
    assert loaded.path == str(loras["inside"])
    replace = common_pb2.LoadLoraAdapterRequest(name="team-a", path=str(loras["inside"]), replace=True)
    with pytest.raises(grpc.RpcError) as info:
        api.LoadLoraAdapter(replace, metadata=auth(KEY_B), timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "replacing" in info.value.details()
    http_unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "team-a"},
                             headers={"authorization": f"Bearer {KEY_B}"}, timeout=30)
    assert http_unload.status_code == 403

    # Names for every key, paths for the admin only.
    listed = {key: api.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), metadata=auth(key), timeout=30).adapters
              for key in (KEY_A, ADMIN)}
    assert [(a.name, a.path) for a in listed[KEY_A]] == [("team-a", "")]
    assert [(a.name, a.path) for a in listed[ADMIN]] == [("team-a", str(loras["inside"]))]
    models = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30).json()["data"]
    assert str(loras["root"]) not in str(models) and [m["id"] for m in models][1:] == ["team-a"]
    api.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="team-a"), metadata=auth(ADMIN), timeout=60)


@pytest.mark.parametrize("which", ["outside", "escape", "dotdot"])
def test_an_adapter_outside_lora_root_is_refused(stack: Stack, loras: dict[str, Path], which: str) -> None:
    request = common_pb2.LoadLoraAdapterRequest(name=f"bad-{which}", path=str(loras[which]))
    with pytest.raises(grpc.RpcError) as info:
        stack.inference.LoadLoraAdapter(request, metadata=auth(ADMIN), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_root" in info.value.details()
    assert not stack.inference.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), metadata=auth(ADMIN),
                                                timeout=30).adapters


def test_the_key_is_checked_before_the_body_is_read(stack: Stack) -> None:
    """Headers announcing a 3 MB body and no body at all: 401 at once (a route reading the body first
    would wait for it, and answer 408 after serving.http_body_timeout_s)."""
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 3000000\r\n\r\n")
        status, headers, body = read_response(sock, 30)
    assert status == 401 and headers.get("www-authenticate") == "Bearer" and b"missing API key" in body


# --- start-up fails closed -------------------------------------------------------------------------

def start(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    return subprocess.run([sys.executable, "-m", "hetero_infer.cli", *flags], cwd=REPO_ROOT, env=env, text=True,
                          capture_output=True, timeout=120)


def test_no_keys_on_a_public_address_stops_start_up(tiny_llama_dir: Path) -> None:
    for command in ("serve", "gateway"):
        ran = start(command, "--model", str(tiny_llama_dir), "--serving-host", "0.0.0.0",
                    "--serving-port", str(free_port()), "--serving-http-port", str(free_port()))
        assert ran.returncode == 1, ran.stderr[-2000:]
        assert "serving.host" in ran.stderr and "serving.api_keys_file" in ran.stderr
        assert "allow_unauthenticated" in ran.stderr


@pytest.mark.parametrize("content", ["", "# only a comment\n\n   \n"])
def test_a_keys_file_with_no_key_stops_start_up(tiny_llama_dir: Path, tmp_path: Path, content: str) -> None:
    for key in ("api-keys-file", "admin-api-keys-file"):
        keys = tmp_path / f"{key}.txt"
        keys.write_text(content)
        ran = start("serve", "--model", str(tiny_llama_dir), f"--serving-{key}", str(keys),
                    "--serving-port", str(free_port()), "--serving-http-port", str(free_port()))
        assert ran.returncode == 1, ran.stderr[-2000:]
        assert str(keys) in ran.stderr and "holds no key" in ran.stderr
