"""Request validation: a GenerateRequest checked field by field and turned into token ids and
sampling parameters (gateway only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.text.chat import chat_chars, render_chat
from hetero.v1 import inference_pb2
from hetero_common.constraints import validate_constraint
from hetero_common.errors import ModelNotFoundError, ValidationError
from hetero_common.sampling import Sampling, validate
from hetero_common.tenancy import scoped_id
from hetero_common.tokenizer import TextTokenizer

MAX_REQUEST_ID_LEN = 128
# Request ids are printable ASCII (space to `~`): they go into log lines, metrics labels, the scheduler's
# keys and HTTP headers, where a NUL or another control character broke the call (UNKNOWN) or a log line.
_REQUEST_ID_CHARS = frozenset(map(chr, range(0x20, 0x7F)))


def request_id_problem(request_id: str) -> str | None:
    """Why `request_id` cannot name a request (None: it can; empty is fine, one is made)."""
    if len(request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id is longer than {MAX_REQUEST_ID_LEN} characters"
    bad = next((c for c in request_id if c not in _REQUEST_ID_CHARS), None)
    if bad is not None:
        return f"request_id holds {bad!r}: only printable ASCII characters (space to '~') are allowed"
    return None


def check_request_id(request_id: str) -> None:
    """Refuse (ValidationError naming `request_id`) an id `request_id_problem` finds fault with."""
    problem = request_id_problem(request_id)
    if problem is not None:
        raise ValidationError(problem, "request_id")


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    adapter: str = ""  # the LoRA adapter `model` named ("" = the base model)
    tenant: str = ""  # the caller's key label ("" = no keys configured): hetero_common/tenancy.py

    @property
    def scoped_id(self) -> str:
        """The id the backend knows this request by (submits, aborts and events use it; the client's
        answers carry `request_id`)."""
        return scoped_id(self.tenant, self.request_id)


def check_model(requested: str, served: str, adapters: Sequence[str] = ()) -> None:
    """`requested` names the served model or one of its LoRA adapters (or is empty: the served model)."""
    if requested and requested != served and requested not in adapters:
        names = ", ".join([repr(served), *(repr(a) for a in adapters)])
        raise ModelNotFoundError(f"model {requested!r} is not served here; this server serves {names} (see ListModels)",
                                 "model")


def too_long(tokens: str, max_model_len: int) -> ValidationError:
    return ValidationError(f"prompt is {tokens} tokens; max_model_len is {max_model_len} (prompt plus at least one "
                           "generated token): shorten the prompt")


def input_chars(request: inference_pb2.GenerateRequest) -> int:
    """What tokenizing the request's input costs: the characters of its prompt or chat messages
    (token ids: one each). Read without copying the text."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt)
    if kind == "chat":
        return chat_chars(request.chat)
    return len(request.prompt_token_ids.ids) if kind == "prompt_token_ids" else 0


def refuse_unfitting(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer, max_model_len: int) -> None:
    """Refuse, before tokenizing it, a prompt or chat too long to fit `max_model_len`: its counted
    characters need at least one token per `tokenizer.bound.max_chars` (hetero_common/token_bound.py).
    A chat's messages count their contents only, trimmed, as a template writes each of them."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        refuse_unfitting_text([request.prompt], tokenizer, max_model_len)
    elif kind == "chat":
        refuse_unfitting_text([m.content.strip() for m in request.chat.messages], tokenizer, max_model_len)


def refuse_unfitting_text(texts: list[str], tokenizer: TextTokenizer, max_model_len: int) -> None:
    """Refuse texts that, together, cannot make fewer than `max_model_len` tokens (`refuse_unfitting`)."""
    tokens = least_tokens(texts, tokenizer, max_model_len)
    if tokens >= max_model_len:
        raise too_long(f"at least {tokens}", max_model_len)


def least_tokens(texts: list[str], tokenizer: TextTokenizer, limit: int) -> int:
    """A true lower bound on the tokens `texts` make together (hetero_common/token_bound.py), worked out only
    when their length says it may reach `limit`; 0 otherwise, and for a tokenizer with no bound."""
    bound = tokenizer.bound
    if bound is None or bound.min_tokens(sum(map(len, texts))) < limit:
        return 0  # the common case: fits, whatever the text holds
    return bound.min_tokens(sum(map(bound.chars, texts)))


def prompt_token_ids(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer,
                     max_model_len: int | None = None) -> list[int]:
    """The request's prompt as token ids; with `max_model_len`, refused first if it cannot fit it."""
    if max_model_len is not None:
        refuse_unfitting(request, tokenizer, max_model_len)
    kind = request.WhichOneof("input")
    if kind is None:
        raise ValidationError("one of prompt, prompt_token_ids or chat is required")
    if kind == "prompt":
        if not request.prompt:
            raise ValidationError("prompt must not be empty")
        ids = tokenizer.encode(request.prompt)
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        if not ids:
            raise ValidationError("prompt_token_ids.ids must not be empty")
        size = tokenizer.vocab_size  # once: the tokenizer computes it on every call
        if max(ids) >= size:
            bad = next(t for t in ids if t >= size)
            raise ValidationError(f"prompt_token_ids.ids holds {bad}, outside the vocabulary (size {size})")
    else:
        # The template already writes the special tokens it needs (e.g. <|im_start|>).
        ids = tokenizer.encode(render_chat(tokenizer, request.chat), add_special_tokens=False)
    if not ids:
        raise ValidationError(f"{kind} tokenizes to zero tokens")
    return ids


def prepare(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer, served_model: str, max_model_len: int,
            request_id: str, serves_lora: bool = False) -> PreparedRequest:
    """Validate every field; raise ValidationError naming the first bad one. `serves_lora`: `model` may name a
    LoRA adapter, which the backend then looks up (NOT_FOUND there when none of that name is loaded)."""
    check_request_id(request.request_id)
    adapter = request.model if serves_lora and request.model not in ("", served_model) else ""
    if not adapter:
        check_model(request.model, served_model)
    sampling = validate(request.params, tokenizer.vocab_size)
    if sampling.constraint is not None:  # compiled against the served vocabulary, once more in the worker
        validate_constraint(request.params, tokenizer.guidance)
    ids = prompt_token_ids(request, tokenizer, max_model_len)
    if len(ids) >= max_model_len:
        count = len(ids)
        del ids  # not kept alive by the traceback of the refusal
        raise too_long(str(count), max_model_len)
    return PreparedRequest(request_id, ids, sampling, adapter)
