"""An EmbedRequest checked field by field and its inputs tokenized (gateway only): every refusal names the field
(`inputs[3].text`, `dimensions`, ...), as generation's validation does (validation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.text.chat import chat_chars, render_chat
from gateway.validation import check_model, check_request_id, least_tokens
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.tokenizer import TextTokenizer


@dataclass
class EmbeddingLimits:
    """What the served model and the config allow an embedding request."""

    served_model: str
    max_model_len: int  # an input may fill it: nothing is generated after it
    max_inputs: int  # serving.embedding.max_inputs
    hidden_size: int | None  # the vectors' length, once known (the first vector tells it)
    serves_lora: bool = False


def check_request(request: inference_pb2.EmbedRequest, limits: EmbeddingLimits) -> str:
    """The request's fields other than its inputs' contents; returns the LoRA adapter `model` names ("": none)."""
    check_request_id(request.request_id)  # length and characters, as a generation's
    adapter = request.model if limits.serves_lora and request.model not in ("", limits.served_model) else ""
    if not adapter:
        check_model(request.model, limits.served_model)
    if not request.inputs:
        raise ValidationError("inputs must hold at least one input", "input")
    if len(request.inputs) > limits.max_inputs:
        raise ValidationError(f"inputs holds {len(request.inputs)} inputs; at most {limits.max_inputs} are taken "
                              "(serving.embedding.max_inputs): split the request", "input")
    if request.pooling not in common_pb2.Pooling.values():  # proto3 enums are open: any number arrives
        raise ValidationError(f"pooling {request.pooling} is none of LAST, MEAN or CLS", "pooling")
    if request.encoding_format not in inference_pb2.EmbeddingEncoding.values():
        raise ValidationError(f"encoding_format {request.encoding_format} is neither FLOAT nor BASE64", "encoding_format")
    if limits.hidden_size is not None and request.dimensions > limits.hidden_size:
        raise ValidationError(f"dimensions is {request.dimensions}; this model's embeddings have {limits.hidden_size} "
                              "values", "dimensions")
    return adapter


def input_chars(request: inference_pb2.EmbedRequest) -> int:
    """What tokenizing the inputs costs, in characters (token ids: one each)."""
    total = 0
    for item in request.inputs:
        kind = item.WhichOneof("input")
        total += (len(item.text) if kind == "text" else len(item.token_ids.ids) if kind == "token_ids"
                  else chat_chars(item.chat) if kind == "chat" else 0)
    return total


def tokenize_inputs(request: inference_pb2.EmbedRequest, tokenizer: TextTokenizer, max_model_len: int) -> list[list[int]]:
    """Each input's token ids: text encoded as is (special tokens as the tokenizer adds them), token ids checked
    against the vocabulary, a chat rendered by the model's template without a generation prompt."""
    refuse_unfitting_texts(request, tokenizer, max_model_len)
    size = tokenizer.vocab_size  # once: the tokenizer computes it on every call
    inputs = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise ValidationError(f"inputs[{i}]: one of text, token_ids or chat is required", "input")
        if kind == "text":
            if not item.text:
                raise ValidationError(f"inputs[{i}].text must not be empty", "input")
            ids = tokenizer.encode(item.text)
        elif kind == "token_ids":
            ids = list(item.token_ids.ids)
            if not ids:
                raise ValidationError(f"inputs[{i}].token_ids must not be empty", "input")
            if max(ids) >= size:
                bad = next(t for t in ids if t >= size)
                raise ValidationError(f"inputs[{i}].token_ids holds {bad}, outside the vocabulary (size {size})",
                                      "input")
        else:
            ids = tokenizer.encode(render_chat(tokenizer, item.chat, add_generation_prompt=False),
                                   add_special_tokens=False)
        if not ids:
            raise ValidationError(f"inputs[{i}].{kind} tokenizes to zero tokens", "input")
        if len(ids) > max_model_len:
            raise ValidationError(f"inputs[{i}] is {len(ids)} tokens; max_model_len is {max_model_len}: shorten it",
                                  "input")
        inputs.append(ids)
    return inputs


def refuse_unfitting_texts(request: inference_pb2.EmbedRequest, tokenizer: TextTokenizer, max_model_len: int) -> None:
    """A text input that cannot make at most `max_model_len` tokens is refused before any is tokenized."""
    for i, item in enumerate(request.inputs):
        tokens = least_tokens([item.text], tokenizer, max_model_len + 1) if item.WhichOneof("input") == "text" else 0
        if tokens > max_model_len:
            raise ValidationError(f"inputs[{i}] is at least {tokens} tokens; max_model_len is {max_model_len}: "
                                  "shorten it", "input")
