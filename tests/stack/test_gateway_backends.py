"""The gateway alone (no scheduler running): command bridge as primary backend and as fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_common.sampling import sample_seed
from hetero_infer.supervisor import wait_healthy
from hetero_infer.bench.harness import REPO_ROOT, free_port

pytestmark = pytest.mark.slow
# Echoes the prompt and max_tokens; samples after the first (n > 1) add their index and seed.
BRIDGE = """import os, sys
e = os.environ
sys.stdout.write('bridge:' + e['HETERO_PROMPT'] + '|' + e['HETERO_MAX_TOKENS'])
if e['HETERO_SAMPLE_INDEX'] != '0':
    sys.stdout.write('#' + e['HETERO_SAMPLE_INDEX'] + ':' + e.get('HETERO_SEED', '-'))
"""


@contextmanager
def gateway(model: Path, *flags: str) -> Iterator[inference_pb2_grpc.InferenceStub]:
    port = free_port()
    cmd = [sys.executable, "-m", "hetero_infer.cli", "gateway", "--model", str(model), "--serving-port", str(port),
           "--scheduler-address", f"127.0.0.1:{free_port()}", "--log-format", "json", "--log-level", "warning", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield inference_pb2_grpc.InferenceStub(channel)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def bridge_flags(tmp_path: Path, *extra: str) -> list[str]:
    script = tmp_path / "bridge.py"
    script.write_text(BRIDGE)
    return ["--serving-backend-command", json.dumps({"program": sys.executable, "args": [str(script)]}), *extra]


PROMPT = 'say "hi"\nthen — 東京'


def test_scheduler_unreachable_falls_back_to_the_bridge(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with gateway(tiny_llama_dir, *bridge_flags(tmp_path, "--serving-backend-fallback", "command_bridge")) as stub:
        params = common_pb2.SamplingParams(max_tokens=9)
        answer = stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60)
        assert answer.text == f"bridge:{PROMPT}|9" and answer.backend == "command_bridge"
        assert answer.finish_reason == common_pb2.FINISH_REASON_STOP and answer.usage.completion_tokens > 0
        messages = list(stub.Generate(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60))
        assert "".join(m.text for m in messages) == answer.text and {m.backend for m in messages} == {"command_bridge"}


def test_scheduler_unreachable_without_fallback_is_unavailable_after_retries(tiny_llama_dir: Path) -> None:
    with gateway(tiny_llama_dir, "--max-retry-attempts", "3") as stub:
        with pytest.raises(grpc.RpcError) as info:  # retries that never ended would end in DEADLINE_EXCEEDED
            stub.Complete(inference_pb2.GenerateRequest(prompt="hi"), timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "after 4 attempt(s)" in info.value.details() and "max_retry_attempts is 3" in info.value.details()


def test_bridge_as_primary_backend(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with gateway(tiny_llama_dir, *bridge_flags(tmp_path, "--serving-backend-kind", "command_bridge")) as stub:
        answer = stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT), timeout=60)
        assert answer.text == f"bridge:{PROMPT}|100" and answer.backend == "command_bridge"
        assert stub.GetServerInfo(inference_pb2.GetServerInfoRequest()).backend == "command_bridge"
        # n = 3: the program runs once per sample, with the seed the engine would give that sample
        params = common_pb2.SamplingParams(max_tokens=4, n=3, seed=5)
        answer = stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60)
        texts = [f"bridge:{PROMPT}|4", f"bridge:{PROMPT}|4#1:{sample_seed(5, 1)}", f"bridge:{PROMPT}|4#2:{sample_seed(5, 2)}"]
        assert [(c.index, c.text) for c in answer.choices] == list(enumerate(texts))
        streamed: dict[int, str] = {}
        for m in stub.Generate(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60):
            streamed[m.index] = streamed.get(m.index, "") + m.text
            if m.HasField("usage"):
                assert m.usage.completion_tokens == answer.usage.completion_tokens > 0
        assert [streamed[i] for i in range(3)] == texts


def test_bridge_refuses_the_logits_controls_it_cannot_honour(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with gateway(tiny_llama_dir, *bridge_flags(tmp_path, "--serving-backend-kind", "command_bridge")) as stub:
        for name, value in [("frequency_penalty", 0.5), ("presence_penalty", 0.5), ("repetition_penalty", 1.2),
                            ("min_p", 0.1), ("min_tokens", 2), ("logit_bias", {5: 1.0})]:
            params = common_pb2.SamplingParams(max_tokens=4, **{name: value})
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"params.{name}" in info.value.details()
        # Their defaults, sent explicitly, are fine.
        params = common_pb2.SamplingParams(max_tokens=4, frequency_penalty=0, repetition_penalty=1, min_tokens=0)
        assert stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60).text == \
            f"bridge:{PROMPT}|4"
        # A constraint (structured output) cannot be applied to a program's text: refused, naming its field.
        for name, value in [("json_schema", '{"type": "object"}'), ("json_object", True), ("regex", "a+"),
                            ("grammar", 'start: "a"'), ("choice", common_pb2.Choices(choices=["a", "b"]))]:
            params = common_pb2.SamplingParams(max_tokens=4, **{name: value})
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(inference_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(f"params.{name} (constrained decoding) is not supported by the "
                                                   "command bridge"), info.value.details()
