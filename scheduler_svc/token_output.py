"""A step's result applied to its sequences (`apply_result`, the body of `Scheduler.process_result`), what one
step produced for one sample (`TokenOutput`: its token, logprobs, finish reason, first-output metrics), and a
step's outputs together (`StepOutputs`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as ListLike
from typing import Protocol

from hetero.v1 import common_pb2, worker_pb2
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.prompt_logprobs import PromptLogprobs
from scheduler_svc.sequence import Sequence, SequenceStatus

PREFILL, DECODE = SequenceStatus.PREFILL, SequenceStatus.DECODE
COMPLETED, FAILED = SequenceStatus.COMPLETED, SequenceStatus.FAILED  # tested with `is`
UNSPECIFIED, LENGTH = common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.FINISH_REASON_LENGTH


class TokenOutput:
    """What one step produced for one request (the service turns it into a TokenEvent).

    A running decode's plain next token is not built as one (`StepOutputs` keeps those as columns); the
    rest are. The sequence-valued fields default to empty tuples; nothing changes an output once built."""

    __slots__ = ("request_id", "token_ids", "finish_reason", "error", "logprobs", "timestamp", "top_logprobs",
                 "queue_seconds", "index", "cached_prompt_tokens", "prompt_logprobs", "prompt_top_logprobs")
    request_id: str
    token_ids: ListLike[int]  # a list of the sampled token on a token's output
    finish_reason: int
    error: str
    logprobs: ListLike[float]
    timestamp: float
    top_logprobs: ListLike[common_pb2.TopLogprobs]  # per token, when asked
    queue_seconds: float  # on the first output: arrival to first admission
    index: int  # sample index (n > 1)
    cached_prompt_tokens: int  # set on a sample's first output
    prompt_logprobs: ListLike[float]  # first output, when params.prompt_logprobs is set
    prompt_top_logprobs: ListLike[common_pb2.TopLogprobs]

    def __init__(self, request_id: str, token_ids: ListLike[int] = (), finish_reason: int = UNSPECIFIED,
                 error: str = "", logprobs: ListLike[float] = (), timestamp: float = 0.0,
                 top_logprobs: ListLike[common_pb2.TopLogprobs] = (), queue_seconds: float = 0.0, index: int = 0,
                 cached_prompt_tokens: int = 0, prompt_logprobs: ListLike[float] = (),
                 prompt_top_logprobs: ListLike[common_pb2.TopLogprobs] = ()) -> None:
        self.request_id, self.token_ids, self.finish_reason, self.error = request_id, token_ids, finish_reason, error
        self.logprobs, self.timestamp, self.top_logprobs = logprobs, timestamp, top_logprobs
        self.queue_seconds, self.index, self.cached_prompt_tokens = queue_seconds, index, cached_prompt_tokens
        self.prompt_logprobs, self.prompt_top_logprobs = prompt_logprobs, prompt_top_logprobs

    def _fields(self) -> tuple:
        return (self.request_id, self.token_ids, self.finish_reason, self.error, self.logprobs, self.timestamp,
                self.top_logprobs, self.queue_seconds, self.index, self.cached_prompt_tokens, self.prompt_logprobs,
                self.prompt_top_logprobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenOutput) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as the dataclass it was)

    def __repr__(self) -> str:
        return f"TokenOutput{self._fields()!r}"


class StepOutputs:
    """One step's outputs, in the order of its result's rows.

    Most rows of a step are a running decode's next token and nothing else. Those are kept as two
    columns, `seqs` and `tokens`, stamped with the step's one `timestamp`, instead of a TokenOutput
    each: building one cost more than all the rest of applying the row (`apply_result`), and the
    service publishes a column entry straight from the sequence (`RequestStreams.dispatch`). Any
    other output (a first token, a finish, logprobs, an error) is a TokenOutput in `others`, with
    the number of column entries before it, so that iterating gives every output in row order.
    A sample has at most one output per step, so the order matters only for reproducibility."""

    __slots__ = ("seqs", "tokens", "timestamp", "others")

    def __init__(self, timestamp: float = 0.0) -> None:
        self.seqs: list[Sequence] = []  # the column entries' sequences (request_id, index)
        self.tokens: list[int] = []  # and their tokens
        self.timestamp = timestamp
        self.others: list[tuple[int, TokenOutput]] = []  # (column entries before it, output)

    @classmethod
    def of(cls, outputs: Iterable[TokenOutput]) -> StepOutputs:
        """Outputs built one by one (an abort, a deadline, a failed step) as a step's outputs."""
        step = cls()
        step.others = [(0, out) for out in outputs]
        return step

    def add(self, out: TokenOutput) -> None:
        self.others.append((len(self.seqs), out))

    def runs(self) -> Iterator[tuple[int, int, TokenOutput | None]]:
        """The outputs in row order as (start, stop, other): column entries start..stop-1, then `other`
        (None after the last run). What a consumer that reads the columns itself walks."""
        start = 0
        for before, out in self.others:
            yield start, before, out
            start = before
        yield start, len(self.seqs), None

    def __iter__(self) -> Iterator[TokenOutput]:
        """Every output as a TokenOutput, in row order (tests, the in-process engine)."""
        seqs, tokens, now = self.seqs, self.tokens, self.timestamp
        for start, stop, other in self.runs():
            for i in range(start, stop):
                seq = seqs[i]
                yield TokenOutput(seq.request_id, [tokens[i]], timestamp=now, index=seq.index)
            if other is not None:
                yield other

    def __len__(self) -> int:
        return len(self.seqs) + len(self.others)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (StepOutputs, list)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"


class SampledRows:
    """One StepResult's rows as outputs: its repeated fields are read once per step, not per row."""

    def __init__(self, result: worker_pb2.StepResult, sequences: dict[int, Sequence] | None = None) -> None:
        self.result = result
        if result.prompt_logprobs and sequences is not None:  # before this step's first tokens go out
            collect_prompt_logprobs(result, sequences)
        self.logprobs = list(result.logprobs)
        self.num_top = result.num_top_logprobs

    def output(self, seq: Sequence, token: int, row: int, now: float, reason: int) -> TokenOutput:
        """The output for the token the worker sampled for `seq` in row `row`, ending it with `reason` if set."""
        top: ListLike[common_pb2.TopLogprobs] = ()
        if self.num_top and seq.sampling.logprobs:
            result, k, n = self.result, seq.sampling.logprobs, self.num_top
            rows = slice(row * n, (row + 1) * n)
            top = [common_pb2.TopLogprobs(token_ids=result.top_token_ids[rows][:k], logprobs=result.top_logprobs[rows][:k])]
        logprobs = [self.logprobs[row]] if self.logprobs else ()
        if seq.first_output_sent:
            return TokenOutput(seq.request_id, [token], reason, "", logprobs, now, top, 0.0, seq.index, 0)
        prompt_logprobs: tuple[ListLike[float], ListLike[common_pb2.TopLogprobs]] = ((), ())
        if seq.needs_prompt_logits:
            scored = seq.prompt_logprobs or PromptLogprobs(seq.prompt_len)
            prompt_logprobs = scored.take(seq.request_id)
            seq.prompt_logprobs = None
        seq.first_output_sent = True
        return TokenOutput(seq.request_id, [token], reason, "", logprobs, now, top, seq.queue_seconds or 0.0, seq.index,
                           seq.cached_prompt_tokens or 0, *prompt_logprobs)


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


class Scheduler(Protocol):
    """What applying a result touches of the Scheduler (scheduler.py; not imported: it imports this module)."""

    sequences: dict[int, Sequence]
    running: list[Sequence]
    block_size: int
    _in_flight: list[tuple[Sequence, int]]
    _assumed_step: int
    _maybe_stop_ids: set[int]
    _running_in_order: bool
    eos_token_ids: frozenset[int]
    max_model_len: int

    samples: dict[str, list[Sequence]]
    kv_cache: KVCacheManager
    _next_seq_id: int

    def _end(self, seq: Sequence, reason: int, status: SequenceStatus) -> None: ...
    def _finish(self, seq: Sequence, reason: int, status: SequenceStatus) -> None: ...


def count_in_flight(s: Scheduler) -> None:
    """The last plan's entries but its fast decodes (schedule(): those are not in _in_flight) as computed, full
    blocks offered to the prefix cache, in plan order: when its result arrives, before any row frees blocks,
    or when the next step is planned ahead of it (overlap.py)."""
    caching, bs = s.kv_cache.enable_prefix_caching, s.block_size
    register_full_blocks = s.kv_cache.register_full_blocks
    for seq, n in s._in_flight:
        status = seq.status
        if status is DECODE or status is PREFILL:  # not finished, preempted or swapped meanwhile
            computed = seq.num_computed = seq.num_computed + n
            if caching and computed >= (seq.num_registered + 1) * bs:  # a block filled (its check, inlined)
                register_full_blocks(seq)
    s._in_flight = []


def apply_result(s: Scheduler, result: worker_pb2.StepResult) -> StepOutputs:
    """`Scheduler.process_result`: apply one step's sampled tokens; return per-sample outputs (finished ones
    included)."""
    now = time.time()
    # A step planned ahead of (overlap.py) was counted then, and _in_flight is the next step's.
    if not s._in_flight.counted(result.step_id):
        s._in_flight.count(s.kv_cache)
    if result.failures or result.logprobs or result.num_top_logprobs or result.prompt_logprobs:
        return process_rows(s, result, now)
    # The common step: tokens only. A decode's token that is no stop or EOS id, not its sequence's first
    # output, is appended here: under its length limits it goes into the outputs' columns, at them it ends
    # the sequence by length (what process_row would find); any other row takes the general path
    # (process_row). A fast decode's computed count is brought up to date here: every token before the
    # sampled one is computed, which for a row already counted above is no change; it fills no block
    # (KVCacheManager.decode_room), so nothing was to register for it above.
    outputs = StepOutputs(now)
    add_seq, add_token = outputs.seqs.append, outputs.tokens.append
    get = s.sequences.get
    maybe_stop, last_model_len = s._maybe_stop_ids, s.max_model_len - 1
    rows = None
    ended: list[Sequence] = []
    for seq, token in zip(map(get, result.seq_ids), result.token_ids):
        if seq is None:
            continue  # aborted while the step ran
        if seq.status is DECODE and seq.first_output_sent and token not in maybe_stop:
            token_ids = seq.token_ids
            if seq.awaiting_token:  # planned ahead (overlap.py): the token takes its placeholder's place
                num = len(token_ids) - 1
                token_ids[num] = token
                seq.awaiting_token = False
            else:
                seq.num_computed = num = len(token_ids)
                token_ids.append(token)
            if num < seq.last_len and num < last_model_len:
                add_seq(seq)
                add_token(token)
            else:
                outputs.add(TokenOutput(seq.request_id, [token], LENGTH, timestamp=now, index=seq.index))
                s._end(seq, LENGTH, COMPLETED)
                ended.append(seq)
            continue
        if rows is None:
            rows = SampledRows(result)
        process_row(s, seq, token, 0, rows, now, outputs, ended)  # the row index: for logprobs, none here
    if ended:
        drop_ended(s, ended)
    return outputs


def process_rows(s: Scheduler, result: worker_pb2.StepResult, now: float) -> StepOutputs:
    """Every row of a result through `process_row`: a step with logprobs, prompt logprobs or failed samples
    (`Scheduler.process_result` takes the common step, tokens only, on its own fast path)."""
    outputs = StepOutputs(now)
    rows = SampledRows(result, s.sequences)  # files the step's prompt logprobs first
    sequences = s.sequences
    ended: list[Sequence] = []
    failures = {f.seq_id: f.error for f in result.failures}
    for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
        seq = sequences.get(seq_id)
        if seq is None:
            continue  # aborted while the step ran
        if failures and seq_id in failures:  # e.g. the worker could not apply this sample's constraint
            if seq.status is not COMPLETED and seq.status is not FAILED:
                s._finish(seq, common_pb2.FINISH_REASON_ERROR, SequenceStatus.FAILED)
                outputs.add(TokenOutput(seq.request_id, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                        error=f"this sample failed on the worker: {failures[seq_id]}", index=seq.index))
            continue
        process_row(s, seq, token, i, rows, now, outputs, ended)
    if ended:
        drop_ended(s, ended)
    return outputs


def drop_ended(s: Scheduler, ended: list[Sequence]) -> None:
    """Take the sequences that ended in `running` this step off it, in one pass when there are many (a few
    are removed one by one: a search in C each, where a pass rebuilt the whole list in Python)."""
    if len(ended) <= 8:
        for seq in ended:
            s.running.remove(seq)
    else:
        s.running = [q for q in s.running if q.status is not COMPLETED]


def process_row(s: Scheduler, seq: Sequence, token: int, row: int, rows: SampledRows, now: float,
                outputs: StepOutputs, ended: list[Sequence]) -> None:
    """Apply one sampled token to its sequence and append its output. A sequence this ends that is still in
    `running` is added to `ended` and left there until the caller's loop ends (`drop_ended`)."""
    status = seq.status
    if status is COMPLETED or status is FAILED:
        return  # aborted while the step ran
    if seq.pending_forks:
        fork_samples(s, seq)
    was_running = status is PREFILL or status is DECODE  # the statuses in `running`
    if seq.awaiting_token:  # planned ahead (overlap.py): counted then; preempted since, it stays where it is
        seq.token_ids[-1] = token
        seq.awaiting_token = False
    else:
        if was_running:  # every token before the sampled one is computed (a fast decode's count: process_result)
            seq.num_computed = len(seq.token_ids)
        seq.token_ids.append(token)
        seq.status = DECODE
    reason = finish_reason(seq, token, s.eos_token_ids, s.max_model_len)
    outputs.add(rows.output(seq, token, row, now, reason))
    if not reason:
        return
    if was_running:
        s._end(seq, reason, SequenceStatus.COMPLETED)
        ended.append(seq)
    else:
        s._finish(seq, reason, SequenceStatus.COMPLETED)


def fork_samples(s: Scheduler, parent: Sequence) -> None:
    """Samples 1..n-1 of a request whose prompt is computed, sharing its prompt blocks by reference."""
    for index in range(1, parent.pending_forks + 1):
        child = s.kv_cache.fork(parent, index, s._next_seq_id)
        s._next_seq_id += 1
        s.sequences[child.seq_id] = child
        s.samples[parent.request_id].append(child)
        s.running.append(child)
        s._running_in_order = False  # the child was never scheduled
    parent.pending_forks = 0
