"""The HTTP contract, fast: every request field is honoured or refused with a 400 naming it.

The gateway's real FastAPI app, served by Starlette's TestClient, with a real tokenizer and the
real command bridge backend (`echo`, one process per request), so no model is needed: the
hostile bodies from issue 15, every unknown field, every field OpenAI or vLLM define that we do
not serve (refused with a non-default value, accepted with the default), the mapping of the
served fields onto the proto, X-Request-Id, /openapi.json and the tokenizer routes (checked
against `transformers` on the same tokenizer files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.auth import ApiKeys
from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.generation import Generation
from gateway.openai import schema as oa
from gateway.openai.app import HttpApi
from gateway.openai.fields import CHAT, COMPLETION, MESSAGE
from hetero.v1 import scheduler_pb2
from hetero_common.config import BackendConfig, CommandConfig, Config
from hetero_common.errors import UnavailableError
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer
from tests.helpers.http_app import bridge_http_client

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> TextTokenizer:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def client(tokenizer: TextTokenizer):
    with bridge_http_client(tokenizer, max_model_len=64) as c:
        yield c


def post(client: TestClient, path: str, body: Any, **headers: str):
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **headers})


def assert_refused(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------------- hostile bodies

HOSTILE = [  # (route, body, the field the 400 must name); the first six were HTTP 500s in issue 15
    ("/v1/completions", {"prompt": [-5]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [[-5]]}, "prompt[0][0]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 99999999999}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 22693649214625}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 99999999999999999999999}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**32}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 100000}, "top_k"),  # larger than the vocabulary
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # only with echo or prompt_logprobs
    ("/v1/completions", {"prompt": [2**32]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1000]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": [[1], [1000]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt[0]"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "the fox " * 60}, "prompt"),  # longer than max_model_len
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 10**30}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),  # MAX_LOGIT_BIAS
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "priority": 2**31}, "priority"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "nope"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2**32}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": [1000]}, "tokens"),
]


@pytest.mark.parametrize("route,body,param", HOSTILE, ids=[f"{r} {json.dumps(b)[:60]}" for r, b, _ in HOSTILE])
def test_hostile_bodies_get_a_400_naming_the_field(client: TestClient, route: str, body: Any, param: str) -> None:
    assert_refused(post(client, route, body), param)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty",
                                   "repetition_penalty", "min_p"])
def test_nan_and_infinities_are_refused(client: TestClient, field: str, literal: str) -> None:
    raw = '{"prompt": "x", "%s": %s}' % (field, literal)  # Python's JSON parser reads these literals
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_refused(response, field)


def test_a_body_that_is_not_json_is_a_400(client: TestClient) -> None:
    response = client.post("/v1/completions", content="{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------------- unknown fields

UNKNOWN = [
    ("/v1/completions", {"prompt": "x", "foo": 1}, "foo"),
    ("/v1/completions", {"prompt": "x", "request_id": "mine"}, "request_id"),  # vLLM's; send X-Request-Id
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),  # chat's, not completions'
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"bar": True}}, "stream_options.bar"),
    ("/v1/chat/completions", {"messages": MESSAGES, "foo": None}, "foo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
     "messages[0].content[0].foo"),
    ("/v1/chat/completions", {"messages": MESSAGES, "best_of": 1}, "best_of"),
    ("/tokenize", {"prompt": "x", "foo": 1}, "foo"),
    ("/detokenize", {"tokens": [1], "foo": 1}, "foo"),
]


@pytest.mark.parametrize("route,body,param", UNKNOWN, ids=[p for _, _, p in UNKNOWN])
def test_unknown_fields_are_refused_by_name(client: TestClient, route: str, body: Any, param: str) -> None:
    response = post(client, route, body)
    assert_refused(response, param)
    assert "unknown field" in response.json()["error"]["message"]


# ----------------------------------------------------------------------------------- unserved fields

# For every field of the refusal tables: a value the client could mean (refused), and the default.
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    "guided_decoding_backend": ("xgrammar", None),
    "guided_whitespace_pattern": (" ", None),
    "use_beam_search": (True, False),
    "length_penalty": (0.5, 1.0),
    "include_stop_str_in_output": (True, False),
    "spaces_between_special_tokens": (False, True),
    "truncate_prompt_tokens": (5, None),
    "allowed_token_ids": ([1, 2], None),
    "bad_words": (["x"], []),
    "return_tokens_as_token_ids": (True, False),
    "return_token_ids": (True, False),
    "kv_transfer_params": ({"a": 1}, None),
    "vllm_xargs": ({"a": 1}, None),
    "continuous_usage_stats": (True, False),
    "echo": (True, False),
    "suffix": ("tail", None),
    "prompt_embeds": ("AAAA", None),
    "functions": ([{"name": "f"}], []),
    "function_call": ("auto", "none"),
    "store": (True, False),
    "metadata": ({"k": "v"}, {}),
    "modalities": (["text", "audio"], ["text"]),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "reasoning_effort": ("high", None),
    "service_tier": ("flex", "auto"),
    "web_search_options": ({}, None),
    "prompt_cache_key": ("k", None),
    "add_generation_prompt": (False, True),
    "continue_final_message": (True, False),
    "add_special_tokens": (True, False),
    "documents": ([{"text": "x"}], None),
    "chat_template": ("{{ messages }}", None),
    "chat_template_kwargs": ({"enable_thinking": True}, {}),
    "mm_processor_kwargs": ({}, None),
}
STREAM_OPTIONS = {"continuous_usage_stats"}
IN_MESSAGES = {"function_call": ({"name": "f", "arguments": "{}"}, None), "audio": ({"id": "a1"}, None)}


def _unserved_cases() -> list[tuple[str, str]]:
    cases = [("/v1/completions", f) for f in COMPLETION] + [("/v1/chat/completions", f) for f in CHAT]
    return cases + [("message", f) for f in MESSAGE]


def _body(route: str, field: str, value: Any) -> tuple[str, dict[str, Any], str]:
    base: dict[str, Any] = {"prompt": "x"} if route == "/v1/completions" else {"messages": [dict(MESSAGES[0])]}
    if route == "message":
        base["messages"][0][field] = value
        return "/v1/chat/completions", base, f"messages[0].{field}"
    if field in STREAM_OPTIONS:
        return route, {**base, "stream": True, "stream_options": {field: value}}, f"stream_options.{field}"
    if field == "add_special_tokens" and route == "/v1/completions":  # served there; refused for chat
        pytest.skip("add_special_tokens is served on completions")
    return route, {**base, field: value}, field


def test_every_unserved_field_has_test_values() -> None:
    assert {f for _, f in _unserved_cases()} == set(NON_DEFAULT)


@pytest.mark.parametrize("route,field", _unserved_cases(), ids=[f"{r} {f}" for r, f in _unserved_cases()])
def test_unserved_fields_are_refused_unless_default(client: TestClient, route: str, field: str) -> None:
    refused, default = IN_MESSAGES.get(field, NON_DEFAULT[field]) if route == "message" else NON_DEFAULT[field]
    path, body, param = _body(route, field, refused)
    response = post(client, path, body)
    assert_refused(response, param)
    assert "does not serve" in response.json()["error"]["message"]
    path, body, _ = _body(route, field, default)
    accepted = post(client, path, {**body, "max_tokens": 2})
    assert accepted.status_code == 200, accepted.text


def test_defaults_openai_clients_send_are_accepted(client: TestClient) -> None:
    body = {"messages": MESSAGES, "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "store": False,
            "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0, "top_k": -1,
            "n": 1, "user": "u1", "metadata": None, "logprobs": False, "service_tier": "auto", "stream": False}
    assert post(client, "/v1/chat/completions", body).status_code == 200
    auto = post(client, "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"})
    assert auto.status_code == 200  # "auto" with no tools can only answer in text
    named = {"role": "user", "content": "x", "name": "ann", "tool_calls": [], "refusal": None}
    assert post(client, "/v1/chat/completions", {"messages": [named]}).status_code == 200
    assert post(client, "/v1/completions", {"prompt": "x", "best_of": 2, "n": 2, "echo": False, "suffix": None}).status_code == 200


# ----------------------------------------------------------------------------------- served fields

def test_served_fields_reach_the_proto(tokenizer: TextTokenizer) -> None:
    body = oa.CompletionBody(prompt="the fox", frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.3,
                             min_p=0.1, min_tokens=3, logit_bias={"7": -100, " 9 ": 2.5}, stop_token_ids=[4, 5],
                             priority=-3, top_k=0, seed=2**64 - 1, cache_salt="tenant", skip_special_tokens=False)
    (r,) = oa.completion_requests(body, "rid", tokenizer)
    p = r.params
    assert (p.frequency_penalty, p.presence_penalty, p.min_p) == pytest.approx((0.5, -0.25, 0.1))
    assert p.repetition_penalty == pytest.approx(1.3) and p.min_tokens == 3 and dict(p.logit_bias) == {7: -100.0, 9: 2.5}
    assert list(p.stop_token_ids) == [4, 5] and r.priority == -3 and r.cache_salt == "tenant" and p.seed == 2**64 - 1
    assert not p.HasField("top_k") and p.include_special_tokens  # vLLM's top_k 0 (and -1) mean off
    (plain,) = oa.completion_requests(oa.CompletionBody(prompt="the fox"), "rid", tokenizer)
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "top_k"):
        assert not plain.params.HasField(name), name  # unset stays unset: the engine's defaults
    assert not plain.params.logit_bias and plain.priority == 0 and not plain.params.include_special_tokens
    (raw,) = oa.completion_requests(oa.CompletionBody(prompt="the fox", add_special_tokens=False), "rid", tokenizer)
    assert list(raw.prompt_token_ids.ids) == tokenizer.encode("the fox", add_special_tokens=False)
    chat = oa.chat_request(oa.ChatBody(messages=MESSAGES, top_k=5, priority=7, min_tokens=2), "c", tokenizer)
    assert chat.params.top_k == 5 and chat.priority == 7 and chat.params.min_tokens == 2


# ----------------------------------------------------------------------------------- X-Request-Id

def test_x_request_id_is_used_and_echoed(client: TestClient) -> None:
    ok = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2}, **{"X-Request-Id": "client-42"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-42"
    assert ok.json()["id"] == "cmpl-client-42"
    refused = post(client, "/v1/completions", {"prompt": "x", "foo": 1}, **{"X-Request-Id": "client-43"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "client-43"
    with client.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True},
                       headers={"X-Request-Id": "client-44"}) as stream:
        assert stream.status_code == 200 and stream.headers["x-request-id"] == "client-44"
        assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
    made = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2}).headers["x-request-id"]
    assert made and made != post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2}).headers["x-request-id"]


@pytest.mark.parametrize("bad", ["", "has space", "x" * 101, "semi;colon", "caf\u00e9"])
def test_a_bad_x_request_id_is_a_400_naming_the_header(client: TestClient, bad: str) -> None:
    response = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": bad.encode("latin-1")})
    assert_refused(response, "X-Request-Id")


# ----------------------------------------------------------------------------------- /openapi.json

def test_openapi_document_publishes_every_body(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionBody"), ("/v1/chat/completions", "ChatBody"),
                       ("/tokenize", "TokenizeBody"), ("/detokenize", "DetokenizeBody")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(name) and schemas[name]["additionalProperties"] is False
        assert any(p["name"] == "X-Request-Id" for p in doc["paths"][path]["post"]["parameters"])
    assert schemas["CompletionBody"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 2**32 - 1
    assert "/tokenizer_info" in doc["paths"] and "/v1/models" in doc["paths"]
    assert client.get("/docs").status_code == 404


# ----------------------------------------------------------------------------------- tokenizer routes

def test_tokenizer_routes_match_transformers(client: TestClient, tokenizer_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    for text in ("The quick brown fox", "héllo wörld 東京 🙂", "<|im_start|>user\nhi<|im_end|>", " spaces  "):
        for add in (True, False):
            out = post(client, "/tokenize", {"prompt": text, "add_special_tokens": add, "return_token_strs": True}).json()
            expected = hf(text, add_special_tokens=add)["input_ids"]
            assert out["tokens"] == expected and out["count"] == len(expected) and out["max_model_len"] == 64
            assert out["token_strs"] == hf.convert_ids_to_tokens(expected)
            back = post(client, "/detokenize", {"tokens": out["tokens"]}).json()["prompt"]
            assert back == hf.decode(expected) == text  # a byte-level BPE round-trips exactly
    chat = post(client, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["token_strs"] is None
    bare = post(client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == hf.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False)
    info = client.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (hf.eos_token, hf.bos_token)
    assert (info["eos_token_id"], info["bos_token_id"]) == (hf.eos_token_id, hf.bos_token_id)
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["chat_template"] == hf.chat_template
    assert info["model_max_length"] == hf.model_max_length and info["max_model_len"] == 64
    models = client.get("/v1/models").json()["data"][0]
    assert models["eos_token_ids"] == [hf.eos_token_id] and models["bos_token_id"] == hf.bos_token_id
    assert models["max_model_len"] == 64
    # the command bridge's program has a model of its own: no family, no experts
    assert (models["architecture"], models["num_experts"], models["num_experts_per_tok"]) == (None, 0, 0)


def test_tokenizer_routes_check_the_model(client: TestClient) -> None:
    response = post(client, "/tokenize", {"model": "other", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert post(client, "/tokenize", {"model": "SmolLM2-135M-Instruct", "prompt": "x"}).status_code == 200


def test_tokenizer_routes_need_the_api_key_when_keys_are_on(tokenizer: TextTokenizer) -> None:
    generation = Generation(Config(), tokenizer, CommandBridgeBackend(
        CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig("/bin/echo"))), tokenizer, "tiny"))

    async def no_scheduler() -> scheduler_pb2.SchedulerStats:
        raise UnavailableError("no scheduler in this test")

    with TestClient(HttpApi(generation, ApiKeys(["k1"]), no_scheduler).app) as c:
        for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None), ("GET", "/v1/models", None)):
            assert c.request(method, path, json=body).status_code == 401, path
            assert c.request(method, path, json=body, headers={"authorization": "Bearer k1"}).status_code == 200, path
        assert c.get("/openapi.json").status_code == 200  # open, like the probes


def test_embeddings_bodies_are_checked_and_the_bridge_refuses_the_rest(client: TestClient) -> None:
    """/v1/embeddings refuses a bad body by its field before any backend is asked, and a good one with a 400
    that says the command bridge computes no vectors (never a 5xx)."""
    for body, param in (({"input": []}, "input"), ({"input": [-1]}, "input[0]"), ({"input": [[1], "x"]}, "input"),
                        ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "suffix": "y"}, "suffix"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        assert_refused(post(client, "/v1/embeddings", body), param)
    refused = post(client, "/v1/embeddings", {"input": ["hello", "world"]})
    assert refused.status_code == 400 and "command_bridge" in refused.json()["error"]["message"]
