"""Sampling defaults and validation, in one place for the gateway, scheduler and worker.

proto3 zero values are not the defaults (temperature 0 means greedy, not "unset"), so the
message uses `optional` fields and this module fills what the client left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError

DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_STOP_STRINGS = 16
MAX_N = 16  # parallel samples of one prompt (they share the prompt's KV blocks)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    n: int
    logprobs: int | None
    include_special_tokens: bool


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request: distinct per sample and reproducible.
    The engine (forked samples) and the command bridge derive it the same way."""
    return (seed + index * 7919) % 2**64


def resolve(params: common_pb2.SamplingParams) -> Sampling:
    """Fill defaults. Does not validate; call `validate` on client input first."""
    return Sampling(
        max_tokens=params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=params.temperature if params.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=params.top_p if params.HasField("top_p") else DEFAULT_TOP_P,
        top_k=params.top_k if params.HasField("top_k") else 0,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        n=params.n if params.HasField("n") else 1,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        include_special_tokens=params.include_special_tokens,
    )


def validate(params: common_pb2.SamplingParams, vocab_size: int | None = None) -> Sampling:
    """Raise ValidationError naming the field; return the resolved parameters."""
    s = resolve(params)
    # max_tokens 0 scores the prompt only (echo): the engine is asked for one token, which the gateway drops.
    if params.HasField("max_tokens") and s.max_tokens < 1 and not params.HasField("prompt_logprobs"):
        raise ValidationError("params.max_tokens must be >= 1 (got 0) unless prompt_logprobs is set; "
                              "leave it unset for the default of 100")
    if params.HasField("prompt_logprobs") and params.prompt_logprobs > MAX_LOGPROBS:
        raise ValidationError(f"params.prompt_logprobs must be <= {MAX_LOGPROBS} (got {params.prompt_logprobs}; "
                              "over HTTP: prompt_logprobs, or logprobs with echo)")
    if not 0.0 <= s.temperature <= 2.0 or s.temperature != s.temperature:
        raise ValidationError(f"params.temperature must be in [0, 2] (got {s.temperature:g}); 0 means greedy")
    if not 0.0 < s.top_p <= 1.0 or s.top_p != s.top_p:
        raise ValidationError(f"params.top_p must be in (0, 1] (got {s.top_p:g}); 1 disables nucleus sampling")
    if vocab_size is not None and s.top_k > vocab_size:
        raise ValidationError(f"params.top_k must be <= the vocabulary size {vocab_size} (got {s.top_k}); 0 disables it")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise ValidationError(f"params.stop has {len(s.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not stop for stop in s.stop):
        raise ValidationError("params.stop must not contain empty strings")
    if vocab_size is not None and any(t >= vocab_size for t in s.stop_token_ids):
        raise ValidationError(f"params.stop_token_ids must be < the vocabulary size {vocab_size}")
    if not 1 <= s.n <= MAX_N:
        raise ValidationError(f"params.n must be in 1..{MAX_N} (got {s.n})")
    if s.logprobs is not None and s.logprobs > MAX_LOGPROBS:
        raise ValidationError(f"params.logprobs must be <= {MAX_LOGPROBS} (got {s.logprobs})")
    return s
