"""Constrained decoding (structured output): `SamplingParams.constraint` as an llguidance grammar.

One place for the gateway (validation: a bad constraint is INVALID_ARGUMENT naming the field,
before anything is queued) and the worker (one matcher per constrained sequence,
gpu_worker/sampling/constrained.py). The five kinds of the proto's oneof:

- `json_schema`: a JSON Schema (JSON text); the output is compact JSON valid against it;
- `json_object`: any JSON object, compact;
- `regex`: the whole output matches the regular expression (Rust `regex` syntax);
- `grammar`: a Lark grammar in llguidance's dialect, start rule `start`;
- `choice`: exactly one of the strings.

JSON is compact by default (llguidance's `whitespace_flexible: false`: "," and ":" separators, no
whitespace between tokens), because a random sampler with flexible whitespace spends its tokens on
long runs of spaces and newlines. A schema may opt out with its own `x-guidance` options.

llguidance is imported lazily: the scheduler resolves SamplingParams too and never needs it.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError

if TYPE_CHECKING:
    from llguidance import LLTokenizer

MAX_CONSTRAINT_BYTES = 64 * 1024  # a constraint's text (schema, regex, grammar, all choices) at most
MAX_CHOICES = 1024
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# llguidance's JSON compiler options applied before the schema's own `x-guidance`: compact output.
COMPACT_JSON = {"whitespace_flexible": False}
# Objects and arrays a json_schema may nest (32 to 64 schema levels: a property's schema is two levels
# deeper, an `items` schema one). Python's json module recurses per level (a RecursionError near 1,000,
# less on a deep stack) and llguidance refuses past 128, so the depth is measured first, without
# recursion (`json_nesting`).
# Regexes and grammars need no such cap: llguidance parses them in Rust and refuses deep nesting itself.
MAX_SCHEMA_NESTING = 64
_NOT_BRACKET = bytes(set(range(256)) - set(b"[]{}"))  # bytes.translate's deletions: all but brackets
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # an opening bracket +1, a closing one -1 (signed)


@dataclass(frozen=True)
class ConstraintSpec:
    """A request's constraint as sent: `kind` is the oneof field's name, `text` its value (for
    `choice`, the strings as a JSON list; for `json_object`, empty)."""

    kind: str
    text: str

    @property
    def field(self) -> str:
        return f"params.{self.kind}"


def constraint_spec(params: common_pb2.SamplingParams) -> ConstraintSpec | None:
    """The constraint of `params`, or None (no constraint). Cheap: nothing is compiled."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not params.json_object:  # `json_object: false` asks for nothing: the same as no constraint
            return None
        return ConstraintSpec(kind, "")
    if kind == "choice":
        return ConstraintSpec(kind, json.dumps(list(params.choice.choices), ensure_ascii=False))
    return ConstraintSpec(kind, getattr(params, kind))


def json_nesting(text: str | bytes) -> int:
    """How deep the objects and arrays of JSON text nest, counted without recursion (and without parsing:
    brackets inside strings are not counted; the text need not be valid JSON). Strings' escapes are
    dropped first (`\\\\` then `\\"`, as JSON pairs backslashes from the left), which leaves exactly the
    quotes that open and close strings, so every other piece between quotes is outside them. Linear, in C
    loops only (bytes methods and numpy's running sum), so that a body of millions of brackets costs the
    gateway's loop little. The HTTP API measures its bodies with it too (gateway/openai/json_body.py)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[0::2])
    steps = np.frombuffer(outside.translate(None, _NOT_BRACKET).translate(_STEP), dtype=np.int8)
    return int(steps.cumsum(dtype=np.int64).max()) if steps.size else 0


def check_shape(spec: ConstraintSpec) -> None:
    """Size, nesting and emptiness checks that need no compiler (hetero_common.sampling.validate runs these)."""
    size = len(spec.text.encode("utf-8"))
    if size > MAX_CONSTRAINT_BYTES:
        raise ValidationError(f"{spec.field} is {size} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed", spec.kind)
    depth = json_nesting(spec.text) if spec.kind == "json_schema" else 0
    if depth > MAX_SCHEMA_NESTING:  # before anything parses it: json.loads recurses per level
        raise ValidationError(f"{spec.field} nests objects and arrays {depth} deep; at most {MAX_SCHEMA_NESTING} "
                              "levels are allowed", spec.kind)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        if not choices:
            raise ValidationError("params.choice.choices must hold at least one string", spec.kind)
        if len(choices) > MAX_CHOICES:
            raise ValidationError(f"params.choice.choices has {len(choices)} strings; at most {MAX_CHOICES} are allowed",
                                  spec.kind)
        if any(not c for c in choices):
            raise ValidationError("params.choice.choices must not contain empty strings", spec.kind)
    elif spec.kind in ("regex", "grammar", "json_schema") and not spec.text.strip():
        raise ValidationError(f"{spec.field} must not be empty", spec.kind)


@contextmanager
def _too_deep_refused(spec: ConstraintSpec) -> Iterator[None]:
    """A RecursionError while a constraint is read or compiled (whatever `check_shape` let through) is the
    client's constraint nesting too deeply: INVALID_ARGUMENT naming the field, not an internal error."""
    try:
        yield
    except RecursionError:
        raise ValidationError(f"{spec.field} is nested too deeply to compile", spec.kind) from None


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar (its JSON text) of a constraint; raises ValidationError naming the field when
    the text cannot even be read (a schema that is not JSON). Compile errors show up in `validate_grammar`."""
    with _too_deep_refused(spec):
        return _grammar_text(spec)


def _grammar_text(spec: ConstraintSpec) -> str:
    from llguidance import LLMatcher

    check_shape(spec)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT_JSON)
    if spec.kind == "json_schema":
        try:
            schema: Any = json.loads(spec.text)
        except ValueError as exc:
            raise ValidationError(f"params.json_schema is not valid JSON: {exc}", spec.kind) from exc
        if not isinstance(schema, dict):
            raise ValidationError(f"params.json_schema must be a JSON object (a schema), not {type(schema).__name__}",
                                  spec.kind)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
        except (ValueError, TypeError) as exc:
            raise ValidationError(f"params.json_schema: {exc}", spec.kind) from exc
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "grammar":
        return LLMatcher.grammar_from_lark(spec.text)
    # choice: one alternative per string, each a Lark string literal (JSON's escapes are Lark's)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.text)))


def check_grammar(spec: ConstraintSpec, grammar: str, tokenizer: LLTokenizer | None) -> None:
    """Compile `grammar` (against `tokenizer` when given: then its tokens' lexing is checked too) and raise
    ValidationError naming the field with llguidance's first error."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        message = (messages[0] if messages else "invalid").strip()
        raise ValidationError(f"{spec.field}: {message}", spec.kind)


def validate_constraint(params: common_pb2.SamplingParams, tokenizer: LLTokenizer | None = None) -> ConstraintSpec | None:
    """The gateway's check of a request's constraint: None when there is none; raises ValidationError with
    `param` the oneof field (`json_schema`, `regex`, ...) and a message starting `params.<field>: `."""
    spec = constraint_spec(params)
    if spec is None:
        return None
    with _too_deep_refused(spec):
        check_grammar(spec, grammar_text(spec), tokenizer)
    return spec


def build_ll_tokenizer(tokenizer_json: str, eos_token_ids: list[int], n_vocab: int | None = None) -> LLTokenizer:
    """llguidance's tokenizer from a `tokenizers` JSON (`tokenizers.Tokenizer.to_str()`: Hugging Face and GGUF
    models alike). `n_vocab`: the width of the logits when it exceeds the tokenizer's (ids past the tokenizer
    are never allowed). EOS ids end a complete constraint; the first is llguidance's main EOS. Costs up to
    about a second for a large vocabulary: build it once."""
    import tokenizers
    from llguidance import LLTokenizer

    if not eos_token_ids:
        raise ValueError("constrained decoding needs the model's end-of-sequence token id; this model has none")
    if n_vocab is not None:  # llguidance refuses a size below the tokenizer's own (ids past the logits are cut later)
        n_vocab = max(n_vocab, tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True))
    return LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_token_ids))

