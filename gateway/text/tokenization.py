"""Tokenize, detokenize and describe the tokenizer: one implementation for gRPC (Tokenize,
Detokenize, ListModels) and HTTP (/tokenize, /detokenize, /tokenizer_info, /v1/models), so both
answer the same."""

from __future__ import annotations

import json
from typing import Any

from gateway.text.chat import chat_chars, render_chat
from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.tokenizer import TextTokenizer

# tokenizer_config.json keys /tokenizer_info does not repeat: file names, and the added-token
# table (large; the ids and strings that matter are given as fields).
CHUNK = 16384  # ids per piece of a large answer: the GIL is held for one piece at a time, not for the whole
_NOT_INFO = ("vocab_file", "merges_file", "tokenizer_file", "added_tokens_decoder", "chat_template")


def tokenize_text(tokenizer: TextTokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_answer(tokenizer: TextTokenizer, request: inference_pb2.TokenizeRequest, max_model_len: int) -> bytes:
    """gRPC Tokenize's answer, serialized (on a tokenizer thread when the input is large: `TokenizerPool`).

    Serialized here, not by gRPC: grpc.aio serializes a returned message on the event loop, and the
    message's C code holds the GIL throughout (0.05-0.15 s for the 3M ids and token texts of a 4 MiB
    prompt), which would stall every other client, on the loop or beside it. So the answer is
    serialized in pieces of CHUNK ids and their texts, each a TokenizeResponse of its own: protobuf
    parses concatenated messages as one, appending their repeated fields in order."""
    ids = _request_ids(tokenizer, request)
    pieces = [inference_pb2.TokenizeResponse(count=len(ids), max_model_len=max_model_len).SerializeToString()]
    for start in range(0, len(ids), CHUNK):
        piece = ids[start:start + CHUNK]
        pieces.append(inference_pb2.TokenizeResponse(token_ids=piece,
                                                     tokens=token_strings(tokenizer, piece)).SerializeToString())
    return b"".join(pieces)


def _request_ids(tokenizer: TextTokenizer, request: inference_pb2.TokenizeRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "chat":
        add = request.add_special_tokens if request.HasField("add_special_tokens") else False
        return tokenizer.encode(render_chat(tokenizer, request.chat), add_special_tokens=add)
    if kind == "text":
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return tokenize_text(tokenizer, request.text, add)
    raise ValidationError("one of text or chat is required")


def json_bytes(answer: dict[str, Any]) -> bytes:
    """`answer` as compact JSON, its lists written in pieces (as `tokenize_answer`): an HTTP /tokenize answer
    of millions of ids rendered on a tokenizer thread without holding the GIL long."""
    fields = []
    for key, value in answer.items():
        if isinstance(value, list):
            pieces = (json.dumps(value[i:i + CHUNK], ensure_ascii=False, separators=(",", ":"))[1:-1]
                      for i in range(0, len(value), CHUNK))
            text = "[" + ",".join(pieces) + "]"
        else:
            text = json.dumps(value, ensure_ascii=False)
        fields.append(f"{json.dumps(key)}:{text}")
    return ("{" + ",".join(fields) + "}").encode()


def tokenize_request_chars(request: inference_pb2.TokenizeRequest) -> int:
    return chat_chars(request.chat) if request.WhichOneof("input") == "chat" else len(request.text)


def token_strings(tokenizer: TextTokenizer, ids: list[int]) -> list[str]:
    """Each id's vocabulary entry (byte-level spelling, e.g. 'Ġthe'), as transformers' convert_ids_to_tokens."""
    return [tokenizer.tokenizer.id_to_token(i) or "" for i in ids]


def detokenize(tokenizer: TextTokenizer, ids: list[int], include_special_tokens: bool = True,
               param: str = "tokens") -> str:
    vocab = tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"{param} holds {bad}, outside the vocabulary (size {vocab})", param)
    return tokenizer.decode(ids, skip_special_tokens=not include_special_tokens)


def tokenizer_info(tokenizer: TextTokenizer, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's fields, special
    tokens as their text) plus its class and chat template; and the ids, which lm-evaluation-harness
    would otherwise find by tokenizing the token texts."""
    info: dict[str, Any] = {}
    for key, value in tokenizer.config.items():
        if key in _NOT_INFO:
            continue
        value = value.get("content") if isinstance(value, dict) and "content" in value else value
        if value is None or isinstance(value, (str, int, float, bool)):
            info[key] = value
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    pad_text = info.get("pad_token")
    pad = tokenizer.tokenizer.token_to_id(pad_text) if isinstance(pad_text, str) else None
    info.update({
        "tokenizer_class": info.get("tokenizer_class") or "PreTrainedTokenizerFast",
        "bos_token": tokenizer.token_text(tokenizer.bos_token_id) or None,
        "eos_token": tokenizer.token_text(eos) or None,
        "pad_token": pad_text if pad is not None else None,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "pad_token_id": pad,
        "add_bos_token": tokenizer.add_bos_token,
        "vocab_size": tokenizer.vocab_size,
        "model_max_length": info.get("model_max_length") or max_model_len,
        "max_model_len": max_model_len,
    })
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
