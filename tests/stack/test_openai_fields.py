"""Every field the API-contract issue lists, sent with a non-default value through the official
`openai` client to a real stack: each is either honoured (and the effect is checked) or answered
with a 400 whose `param` names it. None may be accepted and ignored.

Honoured fields are checked two ways: the HTTP answer equals the gRPC answer for the same
`SamplingParams` (so HTTP maps the field), and it differs from the answer without the field (so
the engine acts on it). The logits-level meaning of each control is tested in
tests/unit/gpu_worker/test_logits_controls.py, and against `transformers` in tests/model/test_sampling_controls_model.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_common.tokenizer import load_tokenizer
from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import Stack, run_stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"  # serving.model_name's default
PROMPT = [17, 42, 99, 5, 230, 61, 17, 42]
NEW = 24


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "8", "--max-model-len", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def http(client: openai.OpenAI, **fields: Any):
    """A greedy completion of PROMPT; OpenAI's own fields as keywords, the rest in the body."""
    known = {"presence_penalty", "frequency_penalty", "logit_bias", "best_of", "n", "max_tokens", "temperature", "seed"}
    kwargs = {"max_tokens": NEW, "temperature": 0.0, **{k: v for k, v in fields.items() if k in known}}
    extra = {"ignore_eos": True, **{k: v for k, v in fields.items() if k not in known}}
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **kwargs)


def grpc_ids(stack: Stack, **params: Any) -> inference_pb2.GenerateResponse:
    p = common_pb2.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name, value in params.items():
        if name == "logit_bias":
            p.logit_bias.update(value)
        elif name == "stop_token_ids":
            p.stop_token_ids.extend(value)
        else:
            setattr(p, name, value)
    request = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=PROMPT), params=p)
    return stack.inference.Complete(request, timeout=60)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 1.5),
    ("frequency_penalty", 1.5),
    ("repetition_penalty", 1.8),
    ("frequency_penalty", -2.0),
])
def test_penalties_are_honoured(stack: Stack, client: openai.OpenAI, field: str, value: float) -> None:
    plain = grpc_ids(stack)
    penalised = grpc_ids(stack, **{field: value})
    assert list(penalised.token_ids) != list(plain.token_ids), f"{field}={value} changed nothing"
    answer = http(client, **{field: value})
    assert answer.choices[0].text == penalised.text
    assert answer.choices[0].text != plain.text


def test_logit_bias_forces_and_bans(stack: Stack, client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    forced = 77
    answer = http(client, logit_bias={str(forced): 100}, max_tokens=6)
    assert answer.choices[0].text == tokenizer.decode([forced] * 6)
    first = grpc_ids(stack).token_ids[0]
    banned = grpc_ids(stack, logit_bias={first: -100.0})
    assert first not in banned.token_ids
    assert http(client, logit_bias={str(first): -100}).choices[0].text == banned.text


def test_min_tokens_holds_back_eos(stack: Stack, client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    eos = load_tokenizer(tiny_llama_dir).eos_token_ids[0]
    bias = {str(eos): 100}  # EOS as soon as it may come
    early = http(client, logit_bias=bias, ignore_eos=False)
    assert early.usage.completion_tokens <= 1 and early.choices[0].finish_reason == "stop"
    held = http(client, logit_bias=bias, ignore_eos=False, min_tokens=5)
    assert held.usage.completion_tokens >= 5 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_completion(stack: Stack, client: openai.OpenAI) -> None:
    ids = list(grpc_ids(stack).token_ids)
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    answer = http(client, stop_token_ids=[ids[stop_at]])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == stop_at + 1  # the stop token is generated, not shown
    assert answer.choices[0].text == grpc_ids(stack, stop_token_ids=[ids[stop_at]]).text


def test_min_p_one_is_greedy(stack: Stack, client: openai.OpenAI) -> None:
    greedy = grpc_ids(stack).text
    assert http(client, temperature=1.0, seed=3, min_p=1.0).choices[0].text == greedy
    assert http(client, temperature=1.0, seed=3).choices[0].text != greedy  # without it: a random draw


@pytest.mark.parametrize("field, value, route", [
    # response_format, structured_outputs, tools and tool_choice are served: tests/stack/test_tool_calls_stack.py.
    ("functions", [{"name": "f", "parameters": {"type": "object"}}], "chat"),
    ("guided_decoding_backend", "xgrammar", "chat"),
    ("best_of", 3, "completions"),
])
def test_unserved_fields_are_refused_naming_them(client: openai.OpenAI, field: str, value: Any, route: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={field: value})
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **{field: value})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field, caught.value.body


def test_best_of_equal_to_n_is_served(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2, best_of=2, temperature=1.0, seed=1)
    assert len(answer.choices) == 2
