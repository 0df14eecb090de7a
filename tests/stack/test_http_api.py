"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real stack,
checked against the gRPC path; plus /metrics, probes and OpenAI error shapes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.supervisor import wait_healthy
from hetero_infer.bench.harness import REPO_ROOT, Stack, free_port, run_stack, wait_for_idle
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"  # serving.model_name's default


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "8", "--max-model-len", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_greedy(stack: Stack, max_tokens: int, logprobs: int | None = None, **input_) -> inference_pb2.GenerateResponse:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if logprobs is not None:
        params.logprobs = logprobs
    return stack.inference.Complete(inference_pb2.GenerateRequest(params=params, **input_))


def test_completion_matches_grpc_with_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    reference = grpc_greedy(stack, 8, logprobs=3, prompt="the river")
    out = client.completions.create(model=MODEL, prompt="the river", max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == reference.usage.prompt_tokens
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in reference.logprobs], abs=1e-5)
    assert len(choice.logprobs.top_logprobs) == 8
    for chosen, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)
        assert all(v <= 0.0 for v in top.values())


def test_streamed_completion_equals_unary(stack: Stack, client: openai.OpenAI) -> None:
    reference = grpc_greedy(stack, 10, prompt="music and light")
    chunks = list(client.completions.create(model=MODEL, prompt="music and light", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 10


def test_stream_is_server_sent_events_ending_done(stack: Stack) -> None:
    body = {"prompt": "water", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_http_clients_that_disconnect_abort_their_requests(long_context_llama_dir: Path) -> None:
    """Closing an SSE stream, or giving up on a JSON answer, ends the generation downstream: the
    scheduler stops long before 3,000 tokens x n = 2 per request could have been generated."""
    body = {"prompt": "the river", "max_tokens": 3000, "temperature": 0, "n": 2, "ignore_eos": True}
    with run_stack(long_context_llama_dir, "--max-model-len", "4096", "--log-level", "warning") as stack:
        with contextlib.ExitStack() as open_streams:
            lines = []  # kept: dropping an iterator would close its stream
            for _ in range(6):
                response = open_streams.enter_context(
                    httpx.stream("POST", f"{stack.http_url}/v1/completions", json={**body, "stream": True}, timeout=60))
                lines.append(response.iter_lines())
                next(line for line in lines[-1] if line.startswith("data: "))  # decoding now
            with httpx.Client(timeout=0.5) as unary, pytest.raises(httpx.ReadTimeout):  # gives up while it runs
                unary.post(f"{stack.http_url}/v1/completions", json=body)
            busy = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool
            assert busy.num_running >= 12 and busy.steps < 1000  # the 6 streams x 2 samples decode
        pool = wait_for_idle(stack, timeout_s=20)
        assert (pool.used_blocks, pool.num_running, pool.num_waiting) == (0, 0, 0)
        assert pool.steps - busy.steps < 1000  # the rest of 3,000 steps was never run


def test_chat_matches_grpc_stream_and_not(stack: Stack, client: openai.OpenAI) -> None:
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role="user", content="hello there")])
    reference = grpc_greedy(stack, 8, logprobs=2, chat=chat)
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == reference.text
    assert out.choices[0].message.role == "assistant"
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in reference.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_several_prompts_with_n_streamed_and_not(stack: Stack, client: openai.OpenAI) -> None:
    """Choice index = prompt index * n + sample; usage counts each prompt once and every sample."""
    first, second = grpc_greedy(stack, 5, prompt="the river"), grpc_greedy(stack, 5, prompt="music and light")
    expected = [first.text] * 2 + [second.text] * 2
    prompt_tokens = first.usage.prompt_tokens + second.usage.prompt_tokens
    kwargs = dict(model=MODEL, prompt=["the river", "music and light"], n=2, max_tokens=5, temperature=0,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 20)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == expected
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 20)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1
    assert chat.usage.completion_tokens == 12


def test_n_seed_and_stop(stack: Stack, client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="the city", max_tokens=6, temperature=0, n=3,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy samples agree
    assert greedy.usage.completion_tokens == 18
    a = client.completions.create(model=MODEL, prompt="the city", max_tokens=6, temperature=1.0, seed=11, n=2,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt="the city", max_tokens=6, temperature=1.0, seed=11, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert len({c.text for c in a.choices}) == 2  # distinct samples
    # HTTP n is gRPC n: the same seeded request over gRPC gives the same samples
    params = common_pb2.SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2, ignore_eos=True)
    via_grpc = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="the city", params=params))
    assert [c.text for c in a.choices] == [c.text for c in sorted(via_grpc.choices, key=lambda c: c.index)]
    assert a.usage.prompt_tokens == via_grpc.usage.prompt_tokens and a.usage.completion_tokens == 12
    # stop: cut before a character of the greedy answer; the same request over gRPC agrees
    full = client.completions.create(model=MODEL, prompt="the city", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    k = next(i for i in range(1, len(full)) if not full[i].isspace())
    stop = full[k]
    cut = client.completions.create(model=MODEL, prompt="the city", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    params = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    via_grpc = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="the city", params=params))
    assert via_grpc.text == cut.text and via_grpc.stop_reason == stop


def test_errors_are_openai_shaped(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    r = httpx.post(f"{stack.http_url}/v1/chat/completions", json={"messages": "nope"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_probes(stack: Stack) -> None:
    assert httpx.get(f"{stack.http_url}/healthz", timeout=10).status_code == 200
    ready = httpx.get(f"{stack.http_url}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["workers_up"] >= 1


def _samples(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"{stack.http_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_metrics_parse_and_move(stack: Stack, client: openai.OpenAI) -> None:
    before = _samples(stack)
    out = client.completions.create(model=MODEL, prompt="the garden and the house", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    grpc_greedy(stack, 4, prompt="a story")  # gRPC requests are metered by the same path
    after = _samples(stack)
    grpc_prompt = len(stack.inference.Tokenize(inference_pb2.TokenizeRequest(text="a story")).token_ids)
    assert after["hetero_prompt_tokens_total"] - before.get("hetero_prompt_tokens_total", 0) == \
        out.usage.prompt_tokens + grpc_prompt
    assert after["hetero_generation_tokens_total"] - before.get("hetero_generation_tokens_total", 0) == 9
    assert after["hetero_time_to_first_token_seconds_count"] - before.get("hetero_time_to_first_token_seconds_count", 0) == 2
    key = "hetero_e2e_request_latency_seconds_count{finish_reason=length}"
    assert after[key] - before.get(key, 0) == 2
    for name in ("hetero_num_requests_running", "hetero_num_requests_waiting", "hetero_kv_blocks_used",
                 "hetero_kv_cache_usage_ratio", "hetero_prefix_cache_queries", "hetero_prefix_cache_hits",
                 "hetero_num_preemptions", "hetero_request_queue_time_seconds_count",
                 "hetero_time_per_output_token_seconds_count"):
        assert name in after, name
    assert after["hetero_kv_blocks"] > 0 and after["hetero_workers_up"] == 1


def test_grpc_top_logprobs_and_timestamps(stack: Stack) -> None:
    params = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=4,
                                       track_generated_token_events=True)
    messages = list(stack.inference.Generate(inference_pb2.GenerateRequest(prompt="the water", params=params)))
    ids = [t for m in messages for t in m.token_ids]
    stamps = [t for m in messages for t in m.token_timestamps]
    assert len(stamps) == len(ids) == 4 and stamps == sorted(stamps) and stamps[0] > 1.6e9
    tops = [alt for m in messages for alt in m.top_logprobs]
    assert len(tops) == 4 and all(len(a.candidates) == 4 for a in tops)
    assert [a.candidates[0].token_id for a in tops] == ids  # greedy picks the top candidate
    plain = list(stack.inference.Generate(inference_pb2.GenerateRequest(
        prompt="the water", params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))))
    assert not any(m.token_timestamps or m.logprobs for m in plain)  # only when asked


def test_health_subcommand(stack: Stack) -> None:
    ok = subprocess.run([sys.executable, "-m", "hetero_infer.cli", "health", stack.address], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    down = subprocess.run([sys.executable, "-m", "hetero_infer.cli", "health", f"127.0.0.1:{free_port()}", "--timeout", "1"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1


def test_reflection_lists_services(stack: Stack) -> None:
    """What `grpcurl -plaintext HOST:PORT list` does, through the reflection API."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"hetero.v1.Inference", "grpc.health.v1.Health"} <= names


def test_overloaded_is_429_and_resource_exhausted(tiny_llama_dir: Path) -> None:
    long_body = {"prompt": "the river", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with run_stack(tiny_llama_dir, "--max-model-len", "2048", "--serving-max-concurrent-requests", "1") as limited:
        # Hold the one slot with a long stream; once its first event arrived it is in flight for 2000 tokens.
        with httpx.stream("POST", f"{limited.http_url}/v1/completions", json=long_body, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept referenced: closing this iterator would close the stream
            assert next(lines).startswith("data: {")
            refused = httpx.post(f"{limited.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(grpc.RpcError) as exhausted:
                grpc_greedy(limited, 2, prompt="x")
            assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the client went away: its request was aborted and the slot is free again
        def not_refused() -> httpx.Response | None:
            r = httpx.post(f"{limited.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            return r if r.status_code != 429 else None

        r = wait_until(not_refused, interval=0.1, what="a request served once the stream holding the slot went away")
        assert r.status_code == 200, r.text


def test_not_ready_without_a_scheduler_is_503(tiny_llama_dir: Path) -> None:
    """A gateway whose scheduler is not there: alive, not ready; generation answers 503."""
    grpc_port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    process = subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", "gateway", "--model", str(tiny_llama_dir),
                                "--serving-port", str(grpc_port), "--serving-http-port", str(http_port),
                                "--scheduler-address", f"127.0.0.1:{free_port()}", "--max-retry-attempts", "0",
                                "--log-format", "json"], cwd=REPO_ROOT, env=env)
    try:
        wait_healthy(f"127.0.0.1:{grpc_port}", 120, process)
        url = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        ready = httpx.get(f"{url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "hetero_scheduler_up 0.0" in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
