"""Prompt logprobs on the public API (SamplingParams.prompt_logprobs), for the scheduler backend.

The scheduler sends them on a request's first token event (sample 0) as bare values; here they
become `GenerateResponse.prompt_logprobs` (token id, logprob and token text of each prompt
token after the first) and `prompt_top_logprobs`. `max_tokens: 0` with prompt logprobs scores
the prompt only: the engine is asked for one token (it samples at least one), and the gateway
drops it, so the client sees no text, no token and `completion_tokens` 0.
"""

from __future__ import annotations

from typing import Callable

from hetero.v1 import common_pb2, inference_pb2, scheduler_pb2


def scoring_only(params: common_pb2.SamplingParams) -> bool:
    """max_tokens 0: the prompt's logprobs are the whole answer (validation allows it only with prompt_logprobs)."""
    return params.HasField("max_tokens") and params.max_tokens == 0


def engine_params(params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """The parameters the scheduler gets: one token for a scoring-only request."""
    if not scoring_only(params):
        return params
    engine = common_pb2.SamplingParams()
    engine.CopyFrom(params)
    engine.max_tokens = 1
    return engine


def drop_generated(response: inference_pb2.GenerateResponse) -> None:
    """A scoring-only request's message: the token the engine had to sample is not the client's."""
    for name in ("text", "token_ids", "logprobs", "top_logprobs", "token_timestamps", "stop_reason"):
        response.ClearField(name)
    if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        response.finish_reason = common_pb2.FINISH_REASON_LENGTH  # max_tokens (0) reached


def add_prompt_logprobs(response: inference_pb2.GenerateResponse, event: scheduler_pb2.TokenEvent,
                        prompt_token_ids: list[int], token_text: Callable[[int], str]) -> None:
    """Entry i scores prompt token i + 1; its alternatives best first (none when prompt_logprobs is 0)."""
    for i, logprob in enumerate(event.prompt_logprobs):
        token_id = prompt_token_ids[i + 1]
        response.prompt_logprobs.add(token_id=token_id, logprob=logprob, token=token_text(token_id))
        alternatives = response.prompt_top_logprobs.add()
        if i < len(event.prompt_top_logprobs):
            top = event.prompt_top_logprobs[i]
            for alt_id, alt_logprob in zip(top.token_ids, top.logprobs):
                alternatives.candidates.add(token_id=alt_id, logprob=alt_logprob, token=token_text(alt_id))
