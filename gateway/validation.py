"""Request validation: a GenerateRequest checked field by field and turned into token ids and
sampling parameters (gateway only)."""

from __future__ import annotations

from dataclasses import dataclass

from hetero_common.tokenizer import TextTokenizer
from gateway.tool_calls import template_input
from hetero.v1 import inference_pb2
from hetero_common.constraints import validate_constraint
from hetero_common.errors import ModelNotFoundError, ValidationError
from hetero_common.sampling import Sampling, validate

MAX_REQUEST_ID_LEN = 128


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling


def check_model(requested: str, served: str) -> None:
    if requested and requested != served:
        raise ModelNotFoundError(f"model {requested!r} is not served here; this server serves {served!r} (see ListModels)",
                                 "model")


def render_chat(tokenizer: TextTokenizer, chat: inference_pb2.Chat, add_generation_prompt: bool = True) -> str:
    """The chat as the model's template writes it, with its tools and tool calls (`tool_calls.py`)."""
    if not tokenizer.chat_template:
        raise ValidationError("this model has no chat template; send `prompt` (plain text) instead of `chat`")
    messages, tools = template_input(chat, tokenizer)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)


def prompt_token_ids(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer) -> list[int]:
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
            request_id: str) -> PreparedRequest:
    """Validate every field; raise ValidationError naming the first bad one."""
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValidationError(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    check_model(request.model, served_model)
    sampling = validate(request.params, tokenizer.vocab_size)
    if sampling.constraint is not None:  # compiled against the served vocabulary, once more in the worker
        validate_constraint(request.params, tokenizer.guidance)
    ids = prompt_token_ids(request, tokenizer)
    if len(ids) >= max_model_len:
        raise ValidationError(f"prompt is {len(ids)} tokens; max_model_len is {max_model_len} (prompt plus at least "
                              "one generated token): shorten the prompt")
    return PreparedRequest(request_id, ids, sampling)
