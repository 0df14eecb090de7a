"""The HTTP contract against a real stack on the tiny model (three processes, real weights):
a schemathesis fuzz of every route from the published /openapi.json (no 5xx, ever), the
tokenizer routes as lm-evaluation-harness's remote tokenizer uses them, gRPC Detokenize and
ListModels' eos/bos ids, and X-Request-Id on a real generation."""

from __future__ import annotations

import copy
import json
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import requests
import requests.adapters

from hetero.v1 import inference_pb2
from hetero_infer.bench.harness import Stack, run_stack

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 32  # generated bodies may ask for 2**32 tokens: they stop here, quickly
EXAMPLES_PER_ROUTE = int(os.environ.get("HETERO_FUZZ_EXAMPLES", "1000"))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "8", "--max-model-len", str(MAX_MODEL_LEN),
                   "--log-level", "warning") as s:
        yield s


def test_fuzzed_bodies_never_get_a_5xx(stack: Stack) -> None:
    """At least EXAMPLES_PER_ROUTE schema-valid bodies per route with a body (schemathesis' positive
    mode: every field in its declared range, unknown ones never) and a quarter as many
    schema-violating ones (negative mode: wrong types, out-of-range numbers, extra fields); the
    GET routes get their headers fuzzed. All through the real stack; any answer below 500
    passes, and a 400 must be OpenAI-shaped. The cases are generated first, then sent 8 at a
    time (the engine batches them), which keeps the test within a couple of minutes."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    document = httpx.get(f"{stack.http_url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                              "/tokenizer_info", "/v1/models", "/v1/embeddings"}
    # Most bodies of the full schema carry some unserved field with a value other than its default
    # (a 400); the served subset (the schema without those fields) reaches the engine with random
    # sampling controls, n, stops and prompts.
    served = schemathesis.openapi.from_dict(_served_subset(document))
    started = time.monotonic()
    counts: dict[str, int] = {}
    cases: list[dict] = []
    plan = [(op, mode, "") for op in operations
            for mode in [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])]
    plan += [(result.ok(), GenerationMode.POSITIVE, " served") for result in served.get_all_operations()
             if result.ok().path in ("/v1/completions", "/v1/chat/completions")]
    for op, mode, variant in plan:
        examples = EXAMPLES_PER_ROUTE if op.method.upper() == "POST" else 50
        examples = examples // 4 if mode is GenerationMode.NEGATIVE else examples // 2 if variant else examples
        key = f"{op.method.upper()} {op.path} {mode.value}{variant}"

        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=op.as_strategy(generation_mode=mode))
        def generate(case) -> None:
            cases.append(case.as_transport_kwargs(base_url=stack.http_url))
            counts[key] = counts.get(key, 0) + 1

        generate()
    generated = time.monotonic() - started
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=8))

    def send(kwargs: dict) -> tuple[dict, int, str]:
        response = session.request(**kwargs, timeout=120)
        return kwargs, response.status_code, response.text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, cases))
    session.close()
    print(f"fuzzed {len(cases)} requests ({generated:.0f} s generating, {time.monotonic() - started:.0f} s in all): "
          f"{counts}; statuses {sorted(Counter(status for _, status, _ in answers).items())}")
    failures = [(kwargs, status, text) for kwargs, status, text in answers if status >= 500]
    assert not failures, failures[:5]
    for kwargs, status, text in answers:
        if status == 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"] == "invalid_request_error", (kwargs, error)
    for op in operations:
        if op.method.upper() == "POST":
            positive = counts.get(f"POST {op.path} positive", 0)
            assert positive >= EXAMPLES_PER_ROUTE, (op.path, positive)
    assert sum(status == 200 for _, status, _ in answers) >= EXAMPLES_PER_ROUTE // 2  # the engine was reached
    assert httpx.get(f"{stack.http_url}/readyz", timeout=30).status_code == 200  # the stack is still sane


def _served_subset(document: dict) -> dict:
    """The OpenAPI document without the fields the server refuses unless they hold their default."""
    from gateway.openai.fields import CHAT, COMPLETION, MESSAGE

    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    for name, unserved in (("CompletionBody", COMPLETION), ("ChatBody", CHAT), ("ChatMessageBody", MESSAGE),
                           ("StreamOptions", COMPLETION)):
        for field in unserved:
            schemas[name]["properties"].pop(field, None)
    return document


def test_hostile_bodies_through_the_stack(stack: Stack) -> None:
    """Issue 15's HTTP 500s, now 400s naming their field, through the real gateway process."""
    for body, param in (({"prompt": [-5]}, "prompt[0]"), ({"prompt": [[-5]]}, "prompt[0][0]"),
                        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": 99999999999}, "max_tokens"),
                        ({"prompt": "x", "logprobs": 22693649214625}, "logprobs"),
                        ({"prompt": "x", "seed": 99999999999999999999999}, "seed"),
                        ({"prompt": "x", "top_k": -3}, "top_k")):
        r = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_remote_tokenizer_of_lm_evaluation_harness(stack: Stack, tiny_llama_dir: Path) -> None:
    """lm_eval's `tokenizer_backend=remote`: its support probe passes, and its tokenizer agrees with
    transformers' on the same files."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    from transformers import PreTrainedTokenizerFast

    base_url = f"{stack.http_url}/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_llama_dir))
    for text in ("Paris is the capital of France.", "naïve café 東京 🙂"):
        ids = remote.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]
        assert remote.decode(ids) == text
    assert (remote.eos_token_id, remote.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert remote.eos_token == hf.eos_token
    messages = [{"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                          tokenize=False)


def test_grpc_detokenize_and_list_models(stack: Stack, tiny_llama_dir: Path) -> None:
    import grpc
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_llama_dir))
    ids = list(stack.inference.Tokenize(inference_pb2.TokenizeRequest(text="the quick brown fox")).token_ids)
    text = stack.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=ids)).text
    assert text == hf.decode(ids, skip_special_tokens=True) == "the quick brown fox"
    special = [hf.bos_token_id, *ids, hf.eos_token_id]
    kept = stack.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=special, include_special_tokens=True))
    assert kept.text == hf.decode(special)
    with pytest.raises(grpc.RpcError) as bad:
        stack.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=[10**6]))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in bad.value.details()
    (card,) = stack.inference.ListModels(inference_pb2.ListModelsRequest()).models
    assert list(card.eos_token_ids) == [hf.eos_token_id] and card.bos_token_id == hf.bos_token_id
    assert card.HasField("bos_token_id") and card.max_model_len == MAX_MODEL_LEN
    models = httpx.get(f"{stack.http_url}/v1/models", timeout=30).json()["data"][0]
    assert models["eos_token_ids"] == [hf.eos_token_id] and models["max_model_len"] == MAX_MODEL_LEN


def test_x_request_id_on_a_real_generation(stack: Stack) -> None:
    body = {"prompt": ["the river", "the city"], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "trace-7"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7"
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert lines and all('"id":"cmpl-trace-7"' in line for line in lines)
    bad = httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "no spaces"},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
