"""Tool calls for chat requests (gRPC `Chat.tools` / `tool_choice`, and HTTP through them).

What this module decides, for both APIs:
- the tools and the history's calls as the chat template sees them (`template_input`): with the
  model's own template when it takes a `tools` variable (the Hugging Face convention), else with
  the documented default system block (`default_tools_block`) and plain-text calls;
- the history's rules (`validate_history`): a tool message answers an earlier call by its id;
- `tool_choice`: `none` offers no tools, `auto` lets the model answer with a call in text, and
  `required` / a named tool constrain the output to a call (`ToolPlan.constraint_schema`, a JSON
  Schema the worker enforces) whose arguments match the tool's `parameters`;
- the answer's calls, parsed from the generated text (`ToolPlan.parse`).
How calls stream is `tool_stream.py`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.tokenizer import TextTokenizer

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NONE, AUTO, REQUIRED = "none", "auto", "required"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


def json_value(text: str) -> Any:
    """json.loads; nesting too deep for the parser is a ValueError like any other bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The Hugging Face chat-template shape of a tool (OpenAI's `tools[]` entry)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass
class ParsedAnswer:
    content: str  # the text that is not a call ("" when the answer is only calls)
    calls: list[inference_pb2.ToolCall] = field(default_factory=list)


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON Schema's shape: an object whose `type`, if any, names JSON types. The engine's
    compiler (llguidance) judges the rest when the schema becomes a constraint."""
    if not isinstance(schema, dict):
        raise ValidationError(f"{param} must be a JSON Schema (a JSON object)", param)
    kinds = schema.get("type", "object")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if not kinds or not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
        raise ValidationError(f"{param} is not a valid JSON Schema: type {schema.get('type')!r} is not one of "
                              f"{', '.join(sorted(_JSON_TYPES))}", param)
    return schema


def tool_specs(chat: inference_pb2.Chat) -> list[ToolSpec]:
    """`chat.tools`, checked: names OpenAI allows, unique; parameters a JSON Schema (empty: any object)."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(chat.tools):
        where = f"chat.tools[{i}]"
        if not _NAME.match(tool.name):
            raise ValidationError(f"{where}.name must be 1-64 characters of A-Z a-z 0-9 _ . - (got {tool.name!r})",
                                  "tools")
        if any(s.name == tool.name for s in specs):
            raise ValidationError(f"{where}.name {tool.name!r} is given twice", "tools")
        try:
            parameters = json_value(tool.parameters_json) if tool.parameters_json else {"type": "object"}
        except ValueError as exc:
            raise ValidationError(f"{where}.parameters_json is not JSON: {exc}", "tools") from None
        specs.append(ToolSpec(tool.name, tool.description, check_schema(parameters, f"{where}.parameters_json")))
    return specs


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json_value(text) if text else {}
    except ValueError as exc:
        raise ValidationError(f"{where} is not JSON: {exc}", where.removeprefix("chat.")) from None
    if not isinstance(value, dict):
        raise ValidationError(f"{where} must be a JSON object", where.removeprefix("chat."))
    return value


def validate_history(chat: inference_pb2.Chat) -> None:
    """Calls only on assistant messages (ids unique, names set, arguments a JSON object); a tool
    message names, by `tool_call_id`, a call made earlier in the conversation."""
    if not chat.messages:
        raise ValidationError("chat.messages must not be empty", "messages")
    calls: dict[str, str] = {}
    for i, m in enumerate(chat.messages):
        where = f"chat.messages[{i}]"
        if m.role not in ("system", "user", "assistant", "tool"):
            raise ValidationError(f"{where}.role must be system, user, assistant or tool (got {m.role!r})",
                                  f"messages[{i}].role")
        if m.tool_calls and m.role != "assistant":
            raise ValidationError(f"{where}.tool_calls: only assistant messages make calls", f"messages[{i}].tool_calls")
        for j, call in enumerate(m.tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if not call.id or call.id in calls:
                raise ValidationError(f"{at}.id must be set and unique in the conversation (got {call.id!r})",
                                      f"messages[{i}].tool_calls[{j}].id")
            if not call.name:
                raise ValidationError(f"{at}.name must be set", f"messages[{i}].tool_calls[{j}].function.name")
            _arguments(call.arguments, f"{at}.arguments")
            calls[call.id] = call.name
        if m.role == "tool":
            if m.tool_call_id not in calls:
                raise ValidationError(f"{where}.tool_call_id {m.tool_call_id!r} names no call made earlier in the "
                                      "conversation (an assistant message's tool_calls[].id)",
                                      f"messages[{i}].tool_call_id")
        elif m.tool_call_id:
            raise ValidationError(f"{where}.tool_call_id: only tool messages answer a call",
                                  f"messages[{i}].tool_call_id")


def default_tools_block(tools: list[ToolSpec], choice: str) -> str:
    """The system text that offers `tools` to a model whose chat template does not take tools."""
    lines = ["You can call functions. These are the functions, one JSON object per line:"]
    lines += [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                         ensure_ascii=False) for t in tools]
    lines.append("To call a function, answer with only this, with the arguments as a JSON object:")
    lines.append(f'{CALL_OPEN}{{"name": "<function name>", "arguments": {{...}}}}{CALL_CLOSE}')
    if choice == AUTO:
        lines.append("If no function is needed, answer normally.")
    elif choice == REQUIRED:
        lines.append("You must call one of the functions.")
    else:
        lines.append(f"You must call the function {choice}.")
    return "\n".join(lines)


def _plain_call(call: inference_pb2.ToolCall) -> str:
    args = _arguments(call.arguments, "arguments")
    return CALL_OPEN + json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False) + CALL_CLOSE


def _plain_messages(chat: inference_pb2.Chat) -> list[dict[str, Any]]:
    """The history for a template without tool support: calls as their text (the default format),
    tool results as user turns in <tool_response> tags (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    names = {c.id: c.name for m in chat.messages for c in m.tool_calls}
    for m in chat.messages:
        if m.role == "tool":
            response = json.dumps({"name": m.name or names.get(m.tool_call_id, ""), "content": m.content},
                                  ensure_ascii=False)
            text = f"<tool_response>{response}</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        content = m.content
        if m.tool_calls:
            content = "\n".join(([content] if content else []) + [_plain_call(c) for c in m.tool_calls])
        out.append({"role": m.role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    return out


def _template_messages(chat: inference_pb2.Chat) -> list[dict[str, Any]]:
    """The history in the Hugging Face convention that tool-aware templates read."""
    out: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments(c.arguments, "arguments")}}
                                     for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def template_input(chat: inference_pb2.Chat, tokenizer: TextTokenizer) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. Tools are offered unless tool_choice is none."""
    validate_history(chat)
    plan = ToolPlan.of(chat)
    offered = plan.tools if plan.choice != NONE else []
    if tokenizer.supports_tools:
        return _template_messages(chat), [t.as_openai() for t in offered] or None
    messages = _plain_messages(chat)
    if offered:
        block = default_tools_block(offered, plan.choice)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, None


@dataclass(frozen=True)
class ToolPlan:
    tools: list[ToolSpec]
    choice: str  # none | auto | required | a tool's name

    @staticmethod
    def of(chat: inference_pb2.Chat) -> "ToolPlan":
        tools = tool_specs(chat)
        choice = chat.tool_choice or (AUTO if tools else NONE)
        if choice not in (NONE, AUTO, REQUIRED):
            if not any(t.name == choice for t in tools):
                raise ValidationError(f"chat.tool_choice names {choice!r}, which is not among chat.tools", "tool_choice")
        elif choice == REQUIRED and not tools:
            raise ValidationError("chat.tool_choice required needs at least one tool in chat.tools", "tool_choice")
        return ToolPlan(tools, choice)

    @property
    def active(self) -> bool:
        """Whether the answer may hold calls."""
        return bool(self.tools) and self.choice != NONE

    @property
    def constrained(self) -> bool:
        return self.active and self.choice != AUTO

    def constraint_schema(self) -> dict[str, Any] | None:
        """`required` / named: the output is one JSON call object, {"name": ..., "arguments": {...}},
        its arguments valid against the tool's parameters (anyOf over the tools for `required`)."""
        if not self.constrained:
            return None
        chosen = self.tools if self.choice == REQUIRED else [t for t in self.tools if t.name == self.choice]
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def _call(self, value: Any) -> inference_pb2.ToolCall | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json_value(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or not any(t.name == value["name"] for t in self.tools):
            return None
        return inference_pb2.ToolCall(id=new_call_id(), name=value["name"],
                                      arguments=json.dumps(args, ensure_ascii=False, separators=(",", ":")))

    def parse(self, text: str) -> ParsedAnswer | None:
        """The calls in a generated answer, or None when it holds none (it is then plain content).
        Read: <tool_call>{"name", "arguments"}</tool_call> blocks (the closing tag may be cut off by the
        end of generation), or the whole answer as one such JSON object or a list of them (the
        constrained modes' output, and templates such as Llama 3's)."""
        if not self.active:
            return None
        try:
            return self._parse(text)
        except (ValueError, RecursionError):  # e.g. arguments nested too deeply to write back out
            return None

    def _parse(self, text: str) -> ParsedAnswer | None:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                value = json_value(stripped)
            except ValueError:
                value = None
            values = value if isinstance(value, list) else [value]
            calls = [self._call(v) for v in values]
            if values and all(calls):
                return ParsedAnswer("", calls)  # type: ignore[arg-type]
        start = text.find(CALL_OPEN)
        if start < 0 or self.constrained:
            return None
        calls = []
        for match in _CALL_BLOCK.finditer(text, start):
            try:
                call = self._call(json_value(match.group(1)))
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return ParsedAnswer(text[:start].strip(), calls) if calls else None
