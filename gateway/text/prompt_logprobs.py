"""Prompt logprobs on the public API (SamplingParams.prompt_logprobs), for the scheduler backend.

The scheduler sends them on a request's first token event (sample 0) as bare values; here they
become `GenerateResponse.prompt_logprobs` (token id, logprob and token text of each prompt
token after the first) and `prompt_top_logprobs`. `max_tokens: 0` with prompt logprobs scores
the prompt only: the engine is asked for one token (it samples at least one), and the gateway
drops it, so the client sees no text, no token and `completion_tokens` 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

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


def add_token_logprobs(entries: Any, alternatives: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                       tops: Sequence[common_pb2.TopLogprobs], token_text: Callable[[int], str]) -> None:
    """Append one TokenLogprob per token to `entries` and its alternatives (best first; none past `tops`)
    to `alternatives`: the shape of both the generated tokens' and the prompt's logprobs."""
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        entries.add(token_id=token_id, logprob=logprob, token=token_text(token_id))
        candidates = alternatives.add().candidates
        if i < len(tops):
            for alt_id, alt_logprob in zip(tops[i].token_ids, tops[i].logprobs):
                candidates.add(token_id=alt_id, logprob=alt_logprob, token=token_text(alt_id))


def add_prompt_logprobs(response: inference_pb2.GenerateResponse, event: scheduler_pb2.TokenEvent,
                        prompt_token_ids: list[int], token_text: Callable[[int], str]) -> None:
    """Entry i scores prompt token i + 1; its alternatives best first (none when prompt_logprobs is 0)."""
    add_token_logprobs(response.prompt_logprobs, response.prompt_top_logprobs, prompt_token_ids[1:],
                       event.prompt_logprobs, event.prompt_top_logprobs, token_text)