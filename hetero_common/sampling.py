"""Sampling defaults and validation, in one place for the gateway, scheduler and worker.

proto3 zero values are not the defaults (temperature 0 means greedy, not "unset"), so the
message uses `optional` fields and this module fills what the client left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from hetero.v1 import common_pb2
from hetero_common.constraints import ConstraintSpec, check_shape, constraint_spec
from hetero_common.errors import ValidationError

DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
MAX_STOP_STRINGS = 16
MAX_N = 16  # parallel samples of one prompt (they share the prompt's KV blocks)
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias


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
    # The logits controls (vLLM's semantics; applied in the worker's sampler, gpu_worker/sampling/logits_processors.py).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    # Structured output (hetero_common/constraints.py; the worker's matcher: gpu_worker/sampling/constrained.py).
    constraint: ConstraintSpec | None = None

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler must keep this sequence's token counts or seen tokens."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def uses_logits_controls(self) -> bool:
        """Whether the sampler changes this sequence's logits before temperature (min_p acts after)."""
        return self.uses_penalties or self.min_tokens > 0 or bool(self.logit_bias)

    @cached_property  # read for every sampled row of every step: computed once
    def uses_sampler_controls(self) -> bool:
        """Whether the sampler has anything to do for this sequence beyond temperature, top-k and top-p."""
        return self.uses_logits_controls or self.min_p > 0.0 or self.constraint is not None


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
        frequency_penalty=params.frequency_penalty if params.HasField("frequency_penalty") else 0.0,
        presence_penalty=params.presence_penalty if params.HasField("presence_penalty") else 0.0,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        min_p=params.min_p if params.HasField("min_p") else 0.0,
        min_tokens=params.min_tokens if params.HasField("min_tokens") else 0,
        logit_bias=dict(params.logit_bias),
        constraint=constraint_spec(params),
    )


def validate(params: common_pb2.SamplingParams, vocab_size: int | None = None) -> Sampling:
    """Raise ValidationError naming the field; return the resolved parameters."""
    if len(params.logit_bias) > MAX_LOGIT_BIAS:  # before copying the map: 200k entries took the gateway 0.1 s and 50 MiB
        raise ValidationError(f"params.logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
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
    _validate_controls(s, vocab_size)
    if s.constraint is not None:
        _validate_constraint_combination(s, s.constraint)
    return s


def _validate_constraint_combination(s: Sampling, spec: ConstraintSpec) -> None:
    """A constrained sample ends with EOS once its constraint is complete (the worker allows nothing else
    then): controls that forbid that EOS would leave no token to sample, so they are refused."""
    check_shape(spec)
    field_name = spec.field
    if s.ignore_eos:
        raise ValidationError(f"params.ignore_eos cannot be combined with {field_name}: a constrained sample ends "
                              "with EOS when its constraint is complete", "ignore_eos")
    if s.min_tokens:
        raise ValidationError(f"params.min_tokens cannot be combined with {field_name}: a constraint may be complete "
                              "before min_tokens tokens, and then only EOS may follow", "min_tokens")


def _in_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """`value` in [low, high] ((low, high] when low_open); NaN and infinities are refused too."""
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise ValidationError(f"params.{name} must be in {'(' if low_open else '['}{low:g}, {high:g}] (got {value:g})")


def _validate_controls(s: Sampling, vocab_size: int | None) -> None:
    _in_range("frequency_penalty", s.frequency_penalty, -2.0, 2.0)
    _in_range("presence_penalty", s.presence_penalty, -2.0, 2.0)
    _in_range("repetition_penalty", s.repetition_penalty, 0.0, 2.0, low_open=True)
    _in_range("min_p", s.min_p, 0.0, 1.0)
    if s.min_tokens > s.max_tokens:
        raise ValidationError(f"params.min_tokens must be <= max_tokens ({s.max_tokens}) (got {s.min_tokens})")
    for token, bias in s.logit_bias.items():
        if vocab_size is not None and token >= vocab_size:
            raise ValidationError(f"params.logit_bias key {token} must be < the vocabulary size {vocab_size}")
        _in_range(f"logit_bias[{token}]", bias, -100.0, 100.0)
