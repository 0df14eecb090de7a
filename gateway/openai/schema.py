"""OpenAI request bodies -> GenerateRequests, and GenerateResponses -> OpenAI response shapes.

Pure translation: no I/O. The bodies and their range checks are `bodies`; the fields
refused by name are `fields`. Here: the checks that need the model (token ids inside
the vocabulary) and the mapping of every served field onto the proto.

`n` samples go to the engine as one request per prompt with `params.n`, exactly as a gRPC
client would send them: the samples share the prompt's KV blocks (copy-on-write), and with a
seed, sample i draws from the same derived seed as gRPC's sample i, so both protocols give the
same samples. Greedy samples are identical, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from gateway.openai.bodies import ChatBody, ChatMessageBody, CompletionBody, StreamOptions, _Body
from gateway.openai.prompt_echo import engine_prompt_logprobs
from gateway.openai.structured import apply_constraint
from gateway.openai.tools import chat_proto
from gateway.validation import refuse_unfitting_text
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.finish_reasons import finish_reason_name, is_finished
from hetero_common.tokenizer import TextTokenizer

__all__ = ["ChatBody", "ChatMessageBody", "CompletionBody", "StreamOptions", "chat_request", "completion_requests"]

# The finish reasons OpenAI clients know; any other (error, deadline) is reported as "error".
OPENAI_FINISH_REASONS = ("stop", "length", "abort", "tool_calls")


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise ValidationError(f"{param} holds token id {bad}, outside the vocabulary (size {vocab_size})", param)


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings: {"50256": -100}."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        text = key.strip()
        if not text.isdecimal() or len(text) > 10 or int(text) >= vocab_size:
            raise ValidationError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        out[int(text)] = value
    return out


def _params(body: _Body, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> common_pb2.SamplingParams:
    """Every served sampling field onto the proto; unset stays unset (the engine's defaults)."""
    p = common_pb2.SamplingParams(ignore_eos=body.ignore_eos, include_special_tokens=not body.skip_special_tokens)
    if body.n != 1:
        p.n = body.n
    if max_tokens is not None:
        p.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    if body.top_k is not None and body.top_k > 0:  # vLLM's -1 and 0 both mean off
        p.top_k = body.top_k
    if body.min_tokens:
        p.min_tokens = body.min_tokens
    if body.stop is not None:
        p.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        _check_ids(body.stop_token_ids, vocab_size, "stop_token_ids")
        p.stop_token_ids.extend(body.stop_token_ids)
    if body.logit_bias:
        p.logit_bias.update(_logit_bias(body.logit_bias, vocab_size))
    if logprobs is not None:
        p.logprobs = logprobs
    if body.prompt_logprobs is not None:
        p.prompt_logprobs = body.prompt_logprobs
    apply_constraint(body.sent(), p)
    return p


def error_renames(body: _Body) -> dict[str, str]:
    """{constraint kind: the HTTP field that set it}: an engine error about the constraint names it."""
    renames = apply_constraint(body.sent(), common_pb2.SamplingParams())
    if isinstance(body, ChatBody) and body.tools and body.tool_choice not in (None, "none", "auto"):
        renames["json_schema"] = "tool_choice"  # the gateway's constraint for required / a named tool
    return renames


def _request(body: _Body, request_id: str, params: common_pb2.SamplingParams) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=request_id, model=body.model or "", params=params,
                                         priority=body.priority, cache_salt=body.cache_salt or "")


def _prompts(body: CompletionBody) -> list[str | list[int]]:
    """The body's prompts: a string or one list of token ids is one prompt; a list of either, that many."""
    if isinstance(body.prompt, str) or isinstance(body.prompt[0], int):
        return [body.prompt]  # type: ignore[list-item]
    return list(body.prompt)  # type: ignore[arg-type]


def check_prompt_count(body: CompletionBody, max_prompts: int) -> None:
    """Refuse (400 naming `prompt`) more prompts than serving.max_prompts_per_request: each is a request
    of `n` samples downstream, so one call of thousands would fill the scheduler's queue for everyone.
    Cheap (no tokenizing): run it before anything else is done with the prompts."""
    count = len(_prompts(body))
    if count > max_prompts:
        raise ValidationError(f"prompt holds {count} prompts; at most {max_prompts} are taken per request "
                              "(serving.max_prompts_per_request): split the request", "prompt")


def completion_requests(body: CompletionBody, request_id: str, tokenizer: TextTokenizer,
                        max_model_len: int | None = None) -> list[inference_pb2.GenerateRequest]:
    """One GenerateRequest per prompt, each asking for n samples; choice index = prompt index * n + sample.
    Request ids are `{request_id}-{prompt index}`. A prompt tokenized here (add_special_tokens false)
    is refused first if it cannot fit `max_model_len` (`refuse_unfitting_text`)."""
    # echo: the HTTP layer prepends the prompt (gateway/openai/prompt_echo.py); with logprobs it needs the prompt's.
    prompt_logprobs = engine_prompt_logprobs(body.echo, body.logprobs, body.prompt_logprobs, body.max_tokens)
    prompts = _prompts(body)
    vocab = tokenizer.vocab_size
    requests = []
    for i, prompt in enumerate(prompts):
        r = _request(body, f"{request_id}-{i}", _params(body, body.max_tokens, body.logprobs, vocab))
        if prompt_logprobs is not None:
            r.params.prompt_logprobs = prompt_logprobs
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str) and body.add_special_tokens:
            r.prompt = prompt  # tokenized downstream, with the model's special tokens, as gRPC's prompt
        else:
            if isinstance(prompt, str) and max_model_len is not None:
                refuse_unfitting_text([prompt], tokenizer, max_model_len)
            ids = prompt if not isinstance(prompt, str) else tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                raise ValidationError(f"{where} must not be empty", where)
            _check_ids(ids, vocab, where)
            r.prompt_token_ids.ids.extend(ids)
        requests.append(r)
    return requests


def prompt_chars(body: CompletionBody) -> int:
    """The characters (or token ids) of a completion's prompts: what tokenizing them costs."""
    prompt = body.prompt
    return len(prompt) if isinstance(prompt, str) else sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


def chat_request(body: ChatBody, request_id: str, tokenizer: TextTokenizer) -> inference_pb2.GenerateRequest:
    chat = chat_proto(body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    r = _request(body, f"{request_id}-0", _params(body, body.effective_max_tokens, logprobs, tokenizer.vocab_size))
    r.chat.CopyFrom(chat)
    return r


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


def usage(per_request: list[common_pb2.Usage]) -> dict[str, Any]:
    """The sum over the prompts' requests. Each request's usage counts its prompt once and the
    tokens of all its n samples, as OpenAI counts them. With speculative decoding, the drafts proposed
    are in completion_tokens_details as OpenAI's predicted outputs report theirs: accepted and rejected."""
    prompt_tokens = sum(u.prompt_tokens for u in per_request)
    completion = sum(u.completion_tokens for u in per_request)
    answer: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                              "total_tokens": prompt_tokens + completion}
    drafted = sum(u.speculative_draft_tokens for u in per_request)
    if drafted:
        accepted = sum(u.speculative_accepted_tokens for u in per_request)
        answer["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                               "rejected_prediction_tokens": drafted - accepted}
    return answer


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], request_id: str,
             model: str, choices: list[dict[str, Any]], created: int | None = None) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices}
