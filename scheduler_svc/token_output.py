"""What one step produced for one sample: its token, logprobs, finish reason, first-output metrics."""

from __future__ import annotations

from collections.abc import Sequence as ListLike
from dataclasses import dataclass, field

from hetero.v1 import common_pb2, worker_pb2
from scheduler_svc.prompt_logprobs import PromptLogprobs
from scheduler_svc.sequence import Sequence


# slots: one is built per sampled sequence per step.
@dataclass(slots=True)
class TokenOutput:
    """What one step produced for one request (the service turns it into a TokenEvent)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: str = ""
    logprobs: list[float] = field(default_factory=list)
    timestamp: float = 0.0
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)  # per token, when asked
    queue_seconds: float = 0.0  # on the first output: arrival to first admission
    index: int = 0  # sample index (n > 1)
    cached_prompt_tokens: int = 0  # set on a sample's first output
    # First output, when params.prompt_logprobs is set. Empty tuples by default: one TokenOutput is built per
    # sampled row per step, and two fresh lists each made the scheduler's per-token cost measurably higher.
    prompt_logprobs: ListLike[float] = ()
    prompt_top_logprobs: ListLike[common_pb2.TopLogprobs] = ()


class SampledRows:
    """One StepResult's rows as outputs: its repeated fields are read once per step, not per row."""

    def __init__(self, result: worker_pb2.StepResult, sequences: dict[int, Sequence] | None = None) -> None:
        self.result = result
        if result.prompt_logprobs and sequences is not None:  # before this step's first tokens go out
            collect_prompt_logprobs(result, sequences)
        self.logprobs = list(result.logprobs)
        self.num_top = result.num_top_logprobs

    def output(self, seq: Sequence, token: int, row: int, now: float) -> TokenOutput:
        """The output for the token the worker sampled for `seq` in row `row`."""
        # Every field positionally (in declaration order): half the cost of keywords and default factories.
        out = TokenOutput(seq.request_id, [token], common_pb2.FINISH_REASON_UNSPECIFIED, "",
                          [self.logprobs[row]] if self.logprobs else [], now, [], 0.0, seq.index, 0)
        if self.num_top and seq.sampling.logprobs:
            result, k, n = self.result, seq.sampling.logprobs, self.num_top
            top = slice(row * n, (row + 1) * n)
            out.top_logprobs = [common_pb2.TopLogprobs(token_ids=result.top_token_ids[top][:k],
                                                       logprobs=result.top_logprobs[top][:k])]
        if not seq.first_output_sent:
            if seq.needs_prompt_logits:
                scored = seq.prompt_logprobs or PromptLogprobs(seq.prompt_len)
                out.prompt_logprobs, out.prompt_top_logprobs = scored.take(seq.request_id)
                seq.prompt_logprobs = None
            out.cached_prompt_tokens = seq.cached_prompt_tokens or 0
            out.queue_seconds = seq.queue_seconds or 0.0
            seq.first_output_sent = True
        return out


def collect_prompt_logprobs(result: worker_pb2.StepResult, sequences: dict[int, Sequence]) -> None:
    """File the step's prompt-logprob entries with their sequences (before the step's first tokens go out)."""
    for entry in result.prompt_logprobs:
        seq = sequences.get(entry.seq_id)
        if seq is not None and seq.needs_prompt_logits:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = PromptLogprobs(seq.prompt_len)
            seq.prompt_logprobs.add(entry)


def finish_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> int:
    """Why `seq` ends with the token just sampled (FINISH_REASON_UNSPECIFIED: it goes on)."""
    s = seq.sampling
    num_tokens = len(seq.token_ids)
    # min_tokens: the worker masks EOS and stop ids until then; this check is the second line of defence.
    if ((token in eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids) and \
            num_tokens - seq.prompt_len > s.min_tokens:
        return common_pb2.FINISH_REASON_STOP
    if num_tokens - seq.prompt_len >= s.max_tokens or num_tokens >= max_model_len:
        return common_pb2.FINISH_REASON_LENGTH
    return common_pb2.FINISH_REASON_UNSPECIFIED
