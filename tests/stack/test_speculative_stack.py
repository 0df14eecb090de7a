"""Speculative decoding (`--speculative-method ngram`, and `draft` with a noisy copy of the model) through the
whole stack (gateway, scheduler, worker: separate processes, the tiny model): the same requests give the same
streams as without it, token for token, over gRPC (greedy with and without stop ids, n = 2, logprobs, seeded
sampling, a tight batch, repeating prompts whose drafts are kept, structured output whose text repeats: a
regex, greedy and seeded, and a JSON Schema) and HTTP with the official `openai` client (a stop string inside
the output); the drafts were proposed and some kept (the Prometheus counters and each request's usage); no KV
block is left in use. And with a worker SIGKILLed mid-stream, every stream is the undisturbed one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import free_port, run_stack, service_stats, wait_for_idle
from tests.helpers.tiny_models import make_noisy_copy
from tests.helpers.oracle import make_prompts
from tests.stack.test_overlap_stack import requests, stream_all
from tests.stack.test_resilience import killer, run_streams, stack_flags, worker_pid
from tests.stack.test_resilience import requests as resilience_requests

slow = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"  # serving.model_name's default
SPECULATION = ("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1")


@pytest.fixture(scope="module")
def method_flags(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, ...]]:
    """Each speculative method's flags; `draft` proposes with a noisy copy of the served model (some drafts
    kept, some not), at every decode (not adaptive: what it costs the tiny model does not matter here)."""
    draft = make_noisy_copy(tiny_llama_dir, tmp_path_factory.mktemp("noisy-draft"), noise=0.2)
    return {"none": (), "ngram": SPECULATION,
            "draft": ("--speculative-method", "draft", "--speculative-model", str(draft), "--num-speculative-tokens", "3",
                      "--speculative-adaptive", "false")}


def repeating(count: int) -> list[inference_pb2.GenerateRequest]:
    """Greedy requests whose prompts repeat a span: lookups find matches from the first decode on."""
    span = [11, 23, 5, 71, 42, 9, 88, 3]
    return [inference_pb2.GenerateRequest(request_id=f"rep{i}", prompt_token_ids=inference_pb2.TokenIds(ids=span[i:] + span * 3),
                                          params=common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i in range(count)]


def constrained() -> list[inference_pb2.GenerateRequest]:
    """Structured output whose text repeats, so that lookups propose inside the grammar (and the grammar
    refuses some drafts)."""
    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 8, "maxItems": 8}
    specs = [dict(regex=r"(the city ){6}[a-z]{1,4}", temperature=0.0),
             dict(regex=r"(cat|dog)( (cat|dog)){12}", temperature=0.9, seed=5),
             dict(json_schema=json.dumps(colors), temperature=0.0)]
    return [inference_pb2.GenerateRequest(request_id=f"c{i}", prompt_token_ids=inference_pb2.TokenIds(ids=make_prompts()[3]),
                                          params=common_pb2.SamplingParams(max_tokens=80, **spec))
            for i, spec in enumerate(specs)]


def speculation_usage(stack) -> tuple[tuple[int, int], object]:
    """A repeating request's final usage over gRPC (drafts proposed, kept) and over HTTP (its
    completion_tokens_details: OpenAI's accepted and rejected prediction tokens)."""
    usage = stack.inference.Complete(repeating(1)[0], timeout=60).usage
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    details = client.completions.create(model=MODEL, prompt="the city the city the city the city", max_tokens=24,
                                        temperature=0).usage.completion_tokens_details
    return (usage.speculative_draft_tokens, usage.speculative_accepted_tokens), details


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def http_answers(url: str) -> list[tuple[str, str]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    full = client.completions.create(model=MODEL, prompt="the city the city the city", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(c for c in full[len(full) // 2:] if not c.isspace())
    cut = client.completions.create(model=MODEL, prompt="the city the city the city", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    return [(full, "length"), (cut.text, cut.finish_reason)]


@slow
def test_speculation_gives_the_same_streams_as_plain_decoding(tiny_llama_dir: Path, method_flags) -> None:
    results, structured, answers = {}, {}, {}
    stop_id = None
    for method in ("none", "ngram", "draft"):
        with run_stack(tiny_llama_dir, *method_flags[method], "--max-batch-size", "4", "--block-size", "4") as stack:
            if stop_id is None:  # a token the greedy stream of prompt 1 produces mid-way
                probe = requests(0)[1]
                probe.params.ClearField("stop_token_ids")
                probe.params.ignore_eos = True
                stop_id = [t for m in stack.inference.Generate(probe, timeout=60) for t in m.token_ids][6]
            results[method] = stream_all(stack, requests(stop_id) + repeating(3))
            before = gauges(stack.http_url)
            structured[method] = stream_all(stack, constrained())
            kept = gauges(stack.http_url)["hetero_spec_decode_accepted_tokens"] - before["hetero_spec_decode_accepted_tokens"]
            assert kept > 0 if method != "none" else kept == 0
            answers[method] = http_answers(stack.http_url)
            (drafted, accepted), details = speculation_usage(stack)
            if method == "none":
                assert drafted == accepted == 0 and details is None
            else:
                assert 0 < accepted <= drafted
                assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
            assert wait_for_idle(stack).used_blocks == 0
            counts = gauges(stack.http_url)
            if method != "none":
                assert counts["hetero_spec_decode_draft_tokens"] > 0
                assert 0 < counts["hetero_spec_decode_accepted_tokens"] <= counts["hetero_spec_decode_draft_tokens"]
            else:
                assert counts["hetero_spec_decode_draft_tokens"] == 0
    assert len(results["none"]) == 12  # 8 requests, one with n = 2, and 3 repeating ones
    assert results["none"][("r1", 0)][2] == common_pb2.FINISH_REASON_STOP
    assert all(finish == common_pb2.FINISH_REASON_STOP for _, _, finish in structured["none"].values())
    assert answers["none"][1][1] == "stop"
    for method in ("ngram", "draft"):
        assert results[method] == results["none"], method
        assert structured[method] == structured["none"], method
        assert answers[method] == answers["none"], method


@slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_replica_killed_mid_stream_changes_no_speculated_stream(tiny_llama_dir: Path, method_flags, method) -> None:
    """Two replicas speculating; one worker SIGKILLed mid-stream: its sequences are recomputed on the other
    (their n-gram state, or their draft model's K/V, rebuilt from their tokens) and every stream, greedy and
    seeded, is the undisturbed one."""
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    streams = resilience_requests(greedy=16, seeded=8)
    flags = stack_flags(addresses, "--restart-workers", "false", *method_flags[method])
    with run_stack(tiny_llama_dir, *flags) as stack:
        reference = run_streams(stack, streams=streams)
        assert all(code is None for _, code in reference.values())
        victim = worker_pid(addresses[1])
        on_progress, killed = killer(lambda: victim, after_tokens=len(streams) * 5)
        disturbed = run_streams(stack, on_progress, streams=streams)
        assert killed.is_set()
        assert disturbed == reference
        assert wait_for_idle(stack).used_blocks == 0
        assert service_stats(stack).num_recovered_sequences > 0
        assert gauges(stack.http_url)["hetero_spec_decode_accepted_tokens"] > 0
