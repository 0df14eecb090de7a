"""OpenAI request bodies -> GenerateRequests, and GenerateResponses -> OpenAI response shapes.

Pure translation: no I/O. Fields OpenAI defines and we serve: model, prompt / messages,
max_tokens / max_completion_tokens, temperature, top_p, n, stop, seed, logprobs
(completions: an int, the number of alternatives; chat: a bool plus top_logprobs), stream,
stream_options.include_usage. Extensions (as vLLM names them): top_k, ignore_eos.
Unknown fields are ignored, as most OpenAI-compatible servers do.

`n` samples go to the engine as one request per prompt with `params.n`, exactly as a gRPC
client would send them: the samples share the prompt's KV blocks (copy-on-write), and with a
seed, sample i draws from the same derived seed as gRPC's sample i, so both protocols give the
same samples. Greedy samples are identical, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.prompt_echo import engine_prompt_logprobs
from gateway.tokenizer import TextTokenizer
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.finish_reasons import finish_reason_name, is_finished
from hetero_common.sampling import MAX_N

# The finish reasons OpenAI clients know; any other (error, deadline) is reported as "error".
OPENAI_FINISH_REASONS = ("stop", "length", "abort")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's extension (gateway/prompt_echo.py)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are served
            if any(part.get("type") != "text" for part in self.content):
                raise ValidationError("messages[].content: only parts of type 'text' are supported")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessageBody]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)


def _params(body: _Body, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(ignore_eos=body.ignore_eos)
    if body.n != 1:
        p.n = body.n
    if max_tokens is not None:
        p.max_tokens = max_tokens
    if body.temperature is not None:
        p.temperature = body.temperature
    if body.top_p is not None:
        p.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:
        p.top_k = body.top_k
    if body.seed is not None:
        p.seed = body.seed
    if body.stop is not None:
        p.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if logprobs is not None:
        p.logprobs = logprobs
    if body.prompt_logprobs is not None:
        p.prompt_logprobs = body.prompt_logprobs
    return p


def _check_n(body: _Body) -> None:
    if not 1 <= body.n <= MAX_N:
        raise ValidationError(f"n must be in 1..{MAX_N} (got {body.n})")


def completion_requests(body: CompletionBody, request_id: str) -> list[inference_pb2.GenerateRequest]:
    """One GenerateRequest per prompt, each asking for n samples; choice index = prompt index * n + sample."""
    _check_n(body)
    # echo: the HTTP layer prepends the prompt (gateway/prompt_echo.py); with logprobs it needs the prompt's.
    prompt_logprobs = engine_prompt_logprobs(body.echo, body.logprobs, body.prompt_logprobs, body.max_tokens)
    prompts: list[str | list[int]]
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts = [body.prompt]  # type: ignore[list-item]
    else:
        prompts = list(body.prompt)  # type: ignore[arg-type]
    if not prompts:
        raise ValidationError("prompt must not be empty")
    requests = []
    for i, prompt in enumerate(prompts):
        r = inference_pb2.GenerateRequest(request_id=f"{request_id}-{i}", model=body.model or "",
                                          params=_params(body, body.max_tokens, body.logprobs))
        if prompt_logprobs is not None:
            r.params.prompt_logprobs = prompt_logprobs
        if isinstance(prompt, str):
            r.prompt = prompt
        else:
            r.prompt_token_ids.ids.extend(prompt)
        requests.append(r)
    return requests


def chat_request(body: ChatBody, request_id: str) -> inference_pb2.GenerateRequest:
    _check_n(body)
    if body.top_logprobs and not body.logprobs:
        raise ValidationError("top_logprobs requires logprobs: true")
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages])
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return inference_pb2.GenerateRequest(request_id=f"{request_id}-0", model=body.model or "", chat=chat,
                                         params=_params(body, max_tokens, logprobs))


# ----------------------------------------------------------------------------- responses

def finish_reason(reason: int) -> str | None:
    """The OpenAI `finish_reason`: None while the choice runs on."""
    if not is_finished(reason):
        return None
    name = finish_reason_name(reason)
    return name if name in OPENAI_FINISH_REASONS else "error"


def completion_logprobs(tokenizer: TextTokenizer, parts: list[inference_pb2.GenerateResponse],
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    if not any(p.logprobs for p in parts):
        return None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for i, lp in enumerate(part.logprobs):
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(lp.logprob)
            alts = part.top_logprobs[i].candidates if i < len(part.top_logprobs) else []
            top: dict[str, float] = {}
            for c in alts:  # best first; two ids can decode to the same text: keep the likelier
                top.setdefault(c.token, c.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(lp.token)
    return out


def chat_logprobs(parts: list[inference_pb2.GenerateResponse]) -> dict[str, Any] | None:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    if not any(p.logprobs for p in parts):
        return None
    content = []
    for part in parts:
        for i, lp in enumerate(part.logprobs):
            alts = part.top_logprobs[i].candidates if i < len(part.top_logprobs) else []
            content.append({"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                            "top_logprobs": [{"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode())}
                                             for c in alts]})
    return {"content": content}


def usage(per_request: list[common_pb2.Usage]) -> dict[str, int]:
    """The sum over the prompts' requests. Each request's usage counts its prompt once and the
    tokens of all its n samples, as OpenAI counts them."""
    prompt_tokens = sum(u.prompt_tokens for u in per_request)
    completion = sum(u.completion_tokens for u in per_request)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], request_id: str,
             model: str, choices: list[dict[str, Any]], created: int | None = None) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices}
