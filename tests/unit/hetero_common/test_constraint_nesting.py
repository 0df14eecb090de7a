"""Issue 58 row 8: a constraint nested too deeply is INVALID_ARGUMENT naming its field, measured without
recursion before anything recursive reads it; a RecursionError in compiling one is the same refusal;
an unexpected error's gRPC status says only that it happened (and the request id), the log the rest."""

from __future__ import annotations

import json
import sys

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from hetero.v1 import common_pb2
from hetero_common import constraints
from hetero_common.constraints import (
    MAX_SCHEMA_NESTING,
    ConstraintSpec,
    check_shape,
    grammar_text,
    json_nesting,
    validate_constraint,
)
from hetero_common.errors import ValidationError
from hetero_common.grpc_server import error_status
from hetero_common.sampling import validate


def nested_schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ("[]", 1), ('{"a":[[1],{"b":{}}]}', 4),
    ('{"a":"[[[[{{{{"}', 1),  # brackets inside strings are text
    ('{"a":"\\"[[[[","b":"\\\\"}', 1),  # an escaped quote does not end the string; an escaped backslash does not escape
    ('["é", "東京", [["🙂"]]]', 3),
    ("[" * 10_000 + "]" * 10_000, 10_000),
    ("]]][", -1),  # not JSON; no deeper than nothing
])
def test_json_nesting_counts_objects_and_arrays_outside_strings(text: str, depth: int) -> None:
    assert json_nesting(text) == depth == json_nesting(text.encode())


def test_json_nesting_needs_no_recursion_at_any_depth() -> None:
    depth = sys.getrecursionlimit() * 50
    assert json_nesting("[" * depth + "]" * depth) == depth


def test_a_schema_at_the_cap_passes_the_shape_check_and_one_level_more_does_not() -> None:
    at_cap = "[" * (MAX_SCHEMA_NESTING - 1) + "{}" + "]" * (MAX_SCHEMA_NESTING - 1)
    check_shape(ConstraintSpec("json_schema", at_cap))
    with pytest.raises(ValidationError) as caught:
        check_shape(ConstraintSpec("json_schema", "[" + at_cap + "]"))
    assert caught.value.param == "json_schema" and caught.value.message.startswith("params.json_schema")


@pytest.mark.parametrize("levels", [33, 100, 500, 1_500])  # 500: json.loads raised RecursionError (UNKNOWN over gRPC)
def test_a_deep_json_schema_is_refused_naming_the_field(levels: int) -> None:
    params = common_pb2.SamplingParams(json_schema=nested_schema(levels))
    for check in (lambda: validate(params, 1000), lambda: validate_constraint(params)):
        with pytest.raises(ValidationError) as caught:
            check()
        assert caught.value.param == "json_schema" and "nests" in caught.value.message


def test_a_schema_within_the_cap_still_compiles() -> None:
    assert validate_constraint(common_pb2.SamplingParams(json_schema=nested_schema(20))) is not None


@pytest.mark.parametrize("kind, text", [
    ("regex", "(" * 30_000 + "a" + ")" * 30_000),
    ("grammar", "start: " + "(" * 20_000 + '"a"' + ")" * 20_000),
    ("grammar", 'start: %json ' + nested_schema(200)),
])
def test_deep_regexes_and_grammars_are_refused_by_the_compiler_naming_the_field(kind: str, text: str) -> None:
    params = common_pb2.SamplingParams(**{kind: text})
    with pytest.raises(ValidationError) as caught:
        validate_constraint(params)
    assert caught.value.param == kind


def test_a_recursion_error_while_compiling_is_a_validation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def recurse(*args: object, **kw: object) -> str:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(constraints, "_grammar_text", recurse)
    spec = ConstraintSpec("json_schema", json.dumps({"type": "object"}))
    with pytest.raises(ValidationError) as caught:
        grammar_text(spec)
    assert caught.value.param == "json_schema"
    with pytest.raises(ValidationError):
        validate_constraint(common_pb2.SamplingParams(json_schema=spec.text))


# ----------------------------------------------------------------------------------- error_status

def test_our_errors_keep_their_status_and_message() -> None:
    assert error_status(ValidationError("prompt is bad", "prompt")) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt is bad")


def test_an_unexpected_error_is_answered_with_the_request_id_and_logged_in_full() -> None:
    structlog.contextvars.bind_contextvars(request_id="req-42")
    try:
        try:
            raise KeyError("/srv/secret/path")
        except KeyError as exc:
            with capture_logs() as logs:
                code, details = error_status(exc)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    assert code == grpc.StatusCode.INTERNAL
    assert "req-42" in details and "secret" not in details and "KeyError" not in details, details
    (entry,) = [e for e in logs if e["event"] == "internal error"]
    assert entry["error_type"] == "KeyError" and "secret" in entry["error"] and entry["exc_info"] is not None
    assert entry["log_level"] == "error"


def test_an_unexpected_error_outside_a_request_says_so_without_an_id() -> None:
    with capture_logs():
        code, details = error_status(RuntimeError("boom"))
    assert code == grpc.StatusCode.INTERNAL and "boom" not in details and "request id" not in details
