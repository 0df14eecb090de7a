"""Structured output and tool calls end to end: the official `openai` client (and gRPC) against
`hetero-infer serve` on SmolLM2-135M-Instruct, greedy.

- a `response_format` `json_schema` answer parses with `json.loads` and validates (`jsonschema`);
- a named `tool_choice` returns `tool_calls` whose arguments validate against the function's
  parameters, and the streamed deltas reassemble into the same call;
- the same constraint and the same tool call through gRPC (`SamplingParams.json_schema`,
  `Chat.tools`), and bad constraints refused with a 400 naming the HTTP field.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import Stack, run_stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK_CITY = [{"role": "user", "content": "What is the capital of France? Answer in JSON with city, country and population."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def stack():
    with run_stack(None, "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_format_json_schema_validates(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), CITY)


def _weather_call(client: openai.OpenAI, **extra: Any):
    return client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40, temperature=0,
                                          tools=TOOLS, tool_choice=NAMED, **extra)  # type: ignore[arg-type]


def test_named_tool_choice_returns_a_valid_call_and_streams_the_same(client: openai.OpenAI) -> None:
    answer = _weather_call(client)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in _weather_call(client, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += piece.id or ""
            entry["name"] += (piece.function.name or "") if piece.function else ""
            entry["arguments"] += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)


def test_required_picks_one_of_the_tools(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40, temperature=0,
                                            tools=TOOLS, tool_choice="required")  # type: ignore[arg-type]
    (call,) = answer.choices[0].message.tool_calls
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_the_same_constraint_and_call_through_grpc(stack: Stack, client: openai.OpenAI) -> None:
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role="user", content=ASK_CITY[0]["content"])])
    params = common_pb2.SamplingParams(max_tokens=48, temperature=0, json_schema=json.dumps(CITY))
    answer = stack.inference.Complete(inference_pb2.GenerateRequest(chat=chat, params=params), timeout=120)
    jsonschema.validate(json.loads(answer.text), CITY)
    http = client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert http.choices[0].message.content == answer.text  # one generation path

    tools = [inference_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role="user", content=ASK_WEATHER[0]["content"])],
                              tools=tools, tool_choice="get_weather")
    params = common_pb2.SamplingParams(max_tokens=40, temperature=0)
    called = stack.inference.Complete(inference_pb2.GenerateRequest(chat=chat, params=params), timeout=120)
    assert called.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS and called.text == ""
    (call,) = called.tool_calls
    assert call.name == "get_weather" and call.arguments == _weather_call(client).choices[0].message.tool_calls[0].function.arguments
    streamed = list(stack.inference.Generate(inference_pb2.GenerateRequest(chat=chat, params=params), timeout=120))
    assert "".join(m.text for m in streamed) == "" and [c.name for c in streamed[-1].tool_calls] == ["get_weather"]
    assert streamed[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


def test_bad_constraints_are_400s_naming_the_field(stack: Stack, client: openai.OpenAI) -> None:
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                  "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}}, "response_format"),
             ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
             ({"extra_body": {"structured_outputs": {"grammar": "start: nosuchrule"}}}, "structured_outputs.grammar")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=8, **fields)
        assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(grpc.RpcError) as refused:
        stack.inference.Complete(inference_pb2.GenerateRequest(
            prompt="x", params=common_pb2.SamplingParams(regex="(unclosed")), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in refused.value.details()
