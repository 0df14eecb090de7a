"""HTTP structured output: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_*` fields, onto `SamplingParams.constraint` (one of json_schema, json_object, regex,
grammar, choice), on both routes.

One constraint per request: two fields that each constrain the output are a 400 naming the
second. The engine compiles the constraint (llguidance); its refusal of a bad schema, regex or
grammar names a `params.<kind>` field, which `renamed_errors` turns into the HTTP field the
client sent (`response_format`, `structured_outputs.regex`, `guided_json`, ...).
"""

from __future__ import annotations

import json
import re
from contextlib import aclosing
from typing import Any, AsyncIterator, TypeVar

from gateway.text.tool_calls import check_schema, json_value
from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# vLLM's StructuredOutputsParams: the constraint fields, and options that change nothing here
# (compact JSON is always produced; there is one backend and no fallback).
_SO_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "grammar",
             "choice": "choice"}
_SO_ANY = {"disable_fallback", "disable_any_whitespace"}
_SO_DEFAULT_ONLY = {"disable_additional_properties": (None, False), "whitespace_pattern": (None,),
                    "structural_tag": (None,)}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_LEADING_KIND = re.compile(r"^(?:params\.)?(" + "|".join(KINDS) + r")\b")


def _error(param: str, message: str) -> ValidationError:
    return ValidationError(f"{param}: {message}", param)


def _schema(value: Any, param: str) -> str:
    """A JSON Schema given as an object or as JSON text (its shape checked here, the rest by the engine's compiler)."""
    if isinstance(value, str):
        try:
            value = json_value(value)
        except ValueError as exc:
            raise _error(param, f"is not JSON: {exc}") from None
    check_schema(value, param)
    try:
        return json.dumps(value)
    except RecursionError:
        raise _error(param, "is nested too deeply") from None


def _value(kind: str, value: Any, param: str) -> Any:
    if kind == "json_schema":
        return _schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise _error(param, "must be true")
        return True
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _error(param, "must be a non-empty list of non-empty strings")
        return common_pb2.Choices(choices=value)
    if not isinstance(value, str) or not value:
        raise _error(param, f"must be a non-empty string ({'a regular expression' if kind == 'regex' else 'a Lark grammar'})")
    return value


def _response_format(rf: dict[str, Any]) -> list[tuple[str, str, Any]]:
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise _error(f"response_format.{sorted(extra)[0]}", "unknown field: this server does not serve it")
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind != "json_schema":
        raise _error("response_format.type", f"must be text, json_object or json_schema (got {kind!r})")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _error("response_format.json_schema", "must be an object with name and schema")
    extra = set(spec) - _JSON_SCHEMA_KEYS
    if extra:
        raise _error(f"response_format.json_schema.{sorted(extra)[0]}", "unknown field: this server does not serve it")
    if "schema" not in spec or spec["schema"] is None:
        return [("response_format", "json_object", True)]  # OpenAI's schema is optional: any JSON object
    return [("response_format", "json_schema", _schema(spec["schema"], "response_format.json_schema.schema"))]


def _structured_outputs(so: dict[str, Any]) -> list[tuple[str, str, Any]]:
    found = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _SO_KINDS:
            if value is not None and value is not False:
                found.append((param, _SO_KINDS[key], _value(_SO_KINDS[key], value, param)))
        elif key in _SO_DEFAULT_ONLY:
            if not any(value is d for d in _SO_DEFAULT_ONLY[key]):
                raise _error(param, f"this server does not serve {param}={value!r}")
        elif key not in _SO_ANY:
            raise _error(param, "unknown field: this server does not serve it")
    return found


def apply_constraint(sent: dict[str, Any], params: common_pb2.SamplingParams) -> dict[str, str]:
    """Set `params`' constraint from the body's fields (`sent`: the fields the client sent).
    Returns {constraint kind: the HTTP field that set it}, for `renamed_errors`."""
    found: list[tuple[str, str, Any]] = []
    if isinstance(sent.get("response_format"), dict):
        found += _response_format(sent["response_format"])
    if sent.get("structured_outputs"):
        found += _structured_outputs(sent["structured_outputs"])
    for name, kind in _GUIDED.items():
        if sent.get(name) is not None:
            found.append((name, kind, _value(kind, sent[name], name)))
    if len(found) > 1:
        raise _error(found[1][0], f"only one constraint per request: {found[0][0]} already constrains the output")
    for param, kind, value in found:
        if kind == "choice":
            params.choice.CopyFrom(value)
        else:
            setattr(params, kind, value)
        return {kind: param}
    return {}


T = TypeVar("T")


def constraint_kind(exc: ValidationError) -> str | None:
    """The constraint field a validation error names, if any."""
    match = _LEADING_KIND.match(exc.param or "") or _LEADING_KIND.match(exc.message)
    return match.group(1) if match else None


async def renamed_errors(events: AsyncIterator[T], renames: dict[str, str]) -> AsyncIterator[T]:
    """`events`, with a refused constraint reported under the HTTP field that set it."""
    async with aclosing(events) as inner:  # type: ignore[type-var]
        try:
            async for item in inner:
                yield item
        except ValidationError as exc:
            kind = constraint_kind(exc)
            if kind is None or kind not in renames:
                raise
            raise ValidationError(f"{renames[kind]}: {exc.message}", renames[kind]) from exc
