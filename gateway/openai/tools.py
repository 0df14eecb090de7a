"""HTTP tool calls: OpenAI's `tools`, `tool_choice` and the history's `tool_calls` / `tool` messages
onto `Chat` (checked here so a 400 names the HTTP field), and `GenerateResponse.tool_calls` back
into OpenAI's response shapes (`message.tool_calls`, streamed `delta.tool_calls`).

What the calls mean (rendering, constraint, parsing) is `tool_calls.py`, shared with gRPC.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai.bodies import ChatBody, ChatMessageBody
from gateway.text.tool_calls import AUTO, NONE, REQUIRED, tool_specs
from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError

_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _error(param: str, message: str) -> ValidationError:
    return ValidationError(f"{param}: {message}", param)


def _object(value: Any, param: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _error(param, "must be an object")
    extra = set(value) - keys
    if extra:
        raise _error(f"{param}.{sorted(extra)[0]}", "unknown field: this server does not serve it")
    return value


def _function(entry: Any, param: str) -> dict[str, Any]:
    """An entry of the form {"type": "function", "function": {...}}: its function object."""
    entry = _object(entry, param, {"type", "function"})
    if entry.get("type") != "function":
        raise _error(f"{param}.type", f"must be \"function\" (got {entry.get('type')!r})")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise _error(f"{param}.function", "must be an object")
    return function


def _tools(tools: list[dict[str, Any]] | None) -> list[inference_pb2.Tool]:
    out = []
    for i, entry in enumerate(tools or []):
        where = f"tools[{i}].function"
        function = _object(_function(entry, f"tools[{i}]"), where, _FUNCTION_KEYS)
        name, description = function.get("name"), function.get("description") or ""
        if not isinstance(name, str) or not isinstance(description, str):
            raise _error(f"{where}.name", "name (and description) must be strings")
        parameters = function.get("parameters")
        tool = inference_pb2.Tool(name=name, description=description,
                                  parameters_json="" if parameters is None else json.dumps(parameters))
        try:
            tool_specs(inference_pb2.Chat(tools=[tool]))
        except ValidationError as exc:
            field = "parameters" if "parameters" in exc.message else "name"
            raise _error(f"{where}.{field}", exc.message.split(": ", 1)[-1] if ": " in exc.message else exc.message)
        out.append(tool)
    names = [t.name for t in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _error(f"tools[{i}].function.name", f"{name!r} is given twice")
    return out


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[inference_pb2.Tool]) -> str:
    if choice is None:
        return ""
    if isinstance(choice, str):
        if choice not in (NONE, AUTO, REQUIRED):
            raise _error("tool_choice", f"must be none, auto, required or {{\"type\": \"function\", \"function\": "
                                        f"{{\"name\": ...}}}} (got {choice!r})")
        if choice == REQUIRED and not tools:
            raise _error("tool_choice", "required needs at least one tool in tools")
        return choice
    name = _object(_function(choice, "tool_choice"), "tool_choice.function", {"name"}).get("name")
    if not any(t.name == name for t in tools):
        raise _error("tool_choice", f"names the function {name!r}, which is not among tools")
    return str(name)


def _calls(message: ChatMessageBody, i: int) -> list[inference_pb2.ToolCall]:
    out = []
    for j, entry in enumerate(message.tool_calls or []):
        where = f"messages[{i}].tool_calls[{j}]"
        entry = _object(entry, where, {"id", "type", "function", "index"})
        if entry.get("type", "function") != "function":
            raise _error(f"{where}.type", "must be \"function\"")
        function = _object(entry.get("function"), f"{where}.function", {"name", "arguments"})
        arguments = function.get("arguments", "")
        if isinstance(arguments, dict):  # OpenAI sends JSON text; an object is taken as meant
            arguments = json.dumps(arguments)
        if not isinstance(function.get("name"), str) or not isinstance(arguments, str) or not isinstance(entry.get("id"), str):
            raise _error(where, "needs id (string), function.name (string) and function.arguments (JSON text)")
        out.append(inference_pb2.ToolCall(id=entry["id"], name=function["name"], arguments=arguments))
    return out


def chat_proto(body: ChatBody) -> inference_pb2.Chat:
    """`messages`, `tools` and `tool_choice` as gRPC's Chat (the history's rules are checked on the
    shared path, `tool_calls.validate_history`, with the same field names)."""
    return chat_of(body.messages, body.tools, body.tool_choice)


def chat_of(messages: list[ChatMessageBody], tools: list[dict[str, Any]] | None,
            tool_choice: str | dict[str, Any] | None) -> inference_pb2.Chat:
    """As `chat_proto`, for any body with OpenAI's messages (also /tokenize's)."""
    specs = _tools(tools)
    chat = inference_pb2.Chat(tools=specs, tool_choice=_tool_choice(tool_choice, specs))
    for i, m in enumerate(messages):
        chat.messages.append(inference_pb2.ChatMessage(role=m.role, content=m.text(), tool_calls=_calls(m, i),
                                                       tool_call_id=m.tool_call_id or "", name=m.name or ""))
    return chat


# ----------------------------------------------------------------------------- responses

def call_json(call: inference_pb2.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(parts: list[inference_pb2.GenerateResponse]) -> dict[str, Any]:
    """A choice's `message`: content null when the answer is only calls."""
    text = "".join(p.text for p in parts)
    calls = [c for p in parts for c in p.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": text if text.strip() or not calls else None}
    if calls:
        message["tool_calls"] = [call_json(c) for c in calls]
    return message


def call_deltas(calls: list[inference_pb2.ToolCall]) -> list[list[dict[str, Any]]]:
    """The streamed `delta.tool_calls` of each chunk, in OpenAI's shape: a call's id, type and name
    first (arguments ""), then its arguments; a client joins the pieces by `index`."""
    return [[{"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}},
             ] for k, c in enumerate(calls)] + [[{"index": k, "function": {"arguments": c.arguments}}]
                                                for k, c in enumerate(calls)]
