"""What one step produced for one sample (`TokenOutput`: its token, logprobs, finish reason, first-output
metrics), a step's outputs together (`StepOutputs`), a result's rows made into outputs (`SampledRows`), and
why a sequence ends with the token it sampled (`finish_reason`). The result is read into its sequences by
result_reader.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as ListLike

from hetero.v1 import common_pb2, worker_pb2
from scheduler_svc.core.prompt_logprobs import PromptLogprobs
from scheduler_svc.sequence import Sequence

UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


class TokenOutput:
    """What one step produced for one request (the service turns it into a TokenEvent).

    A running decode's plain next token is not built as one (`StepOutputs` keeps those as columns); the
    rest are. The sequence-valued fields default to empty tuples; nothing changes an output once built."""

    __slots__ = ("request_id", "token_ids", "finish_reason", "error", "logprobs", "timestamp", "top_logprobs",
                 "queue_seconds", "index", "cached_prompt_tokens", "prompt_logprobs", "prompt_top_logprobs",
                 "draft_tokens", "accepted_drafts", "embedding")
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
    draft_tokens: int  # speculative drafts proposed for this output's tokens
    accepted_drafts: int  # of those, kept (among token_ids)
    embedding: ListLike[float]  # an embedding request's pooled vector (its one output)

    def __init__(self, request_id: str, token_ids: ListLike[int] = (), finish_reason: int = UNSPECIFIED,
                 error: str = "", logprobs: ListLike[float] = (), timestamp: float = 0.0,
                 top_logprobs: ListLike[common_pb2.TopLogprobs] = (), queue_seconds: float = 0.0, index: int = 0,
                 cached_prompt_tokens: int = 0, prompt_logprobs: ListLike[float] = (),
                 prompt_top_logprobs: ListLike[common_pb2.TopLogprobs] = (), draft_tokens: int = 0,
                 accepted_drafts: int = 0, embedding: ListLike[float] = ()) -> None:
        self.request_id, self.token_ids, self.finish_reason, self.error = request_id, token_ids, finish_reason, error
        self.logprobs, self.timestamp, self.top_logprobs = logprobs, timestamp, top_logprobs
        self.queue_seconds, self.index, self.cached_prompt_tokens = queue_seconds, index, cached_prompt_tokens
        self.prompt_logprobs, self.prompt_top_logprobs = prompt_logprobs, prompt_top_logprobs
        self.draft_tokens, self.accepted_drafts, self.embedding = draft_tokens, accepted_drafts, embedding

    def _fields(self) -> tuple:
        return (self.request_id, self.token_ids, self.finish_reason, self.error, self.logprobs, self.timestamp,
                self.top_logprobs, self.queue_seconds, self.index, self.cached_prompt_tokens, self.prompt_logprobs,
                self.prompt_top_logprobs, self.draft_tokens, self.accepted_drafts, self.embedding)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenOutput) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as the dataclass it was)

    def __repr__(self) -> str:
        return f"TokenOutput{self._fields()!r}"


class StepOutputs:
    """One step's outputs, in the order of its result's rows.

    Most rows of a step are a running decode's next token and nothing else. Those are kept as two
    columns, `seqs` and `tokens`, stamped with the step's one `timestamp`, instead of a TokenOutput
    each: building one cost more than all the rest of applying the row (`ResultReader.read`), and the
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
                yield TokenOutput(seq.info.request_id, [tokens[i]], timestamp=now, index=seq.info.index)
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

    def __init__(self, result: worker_pb2.StepResult, prompt_logprobs: dict[int, PromptLogprobs],
                 sequences: dict[int, Sequence] | None = None) -> None:
        """`prompt_logprobs`: each sample's so far, by seq id (the result reader's), taken by its first output."""
        self.result = result
        self.prompt_logprobs = prompt_logprobs
        if result.prompt_logprobs and sequences is not None:  # before this step's first tokens go out
            collect_prompt_logprobs(result, sequences, prompt_logprobs)
        self.logprobs = list(result.logprobs)
        self.draft_logprobs = list(result.accepted_draft_logprobs)
        self.num_top = result.num_top_logprobs

    def output(self, seq: Sequence, token: int, row: int, now: float, reason: int,
               tokens: ListLike[int] | None = None, first_draft: int = 0, num_drafts: int = 0) -> TokenOutput:
        """The output for the token the worker sampled for `seq` in row `row`, ending it with `reason` if set.
        `tokens`: what the row emitted where it kept speculative drafts (`num_drafts` of them, the step's
        `first_draft`-th kept draft first), then its token unless a stop cut the run before it."""
        emitted = [token] if tokens is None else tokens
        top: ListLike[common_pb2.TopLogprobs] = ()
        logprobs: ListLike[float] = ()
        if tokens is not None:
            logprobs, top = self._scores(seq, row, first_draft, min(len(emitted), num_drafts), len(emitted) > num_drafts)
        elif self.num_top and seq.info.sampling.logprobs:
            result, k, n = self.result, seq.info.sampling.logprobs, self.num_top
            rows = slice(row * n, (row + 1) * n)
            top = [common_pb2.TopLogprobs(token_ids=result.top_token_ids[rows][:k], logprobs=result.top_logprobs[rows][:k])]
        if tokens is None and self.logprobs:
            logprobs = [self.logprobs[row]]
        if seq.first_output_sent:
            return TokenOutput(seq.info.request_id, emitted, reason, "", logprobs, now, top, 0.0, seq.info.index, 0)
        prompt_logprobs: tuple[ListLike[float], ListLike[common_pb2.TopLogprobs]] = ((), ())
        if seq.needs_prompt_logits:
            scored = self.prompt_logprobs.pop(seq.seq_id, None) or PromptLogprobs(seq.info.prompt_len)
            prompt_logprobs = scored.take(seq.info.request_id)
        seq.first_output_sent = True
        return TokenOutput(seq.info.request_id, emitted, reason, "", logprobs, now, top, seq.queue_seconds or 0.0,
                           seq.info.index, seq.cached_prompt_tokens or 0, *prompt_logprobs)


    def _scores(self, seq: Sequence, row: int, first_draft: int, num_drafts: int,
                with_token: bool) -> tuple[list[float], list[common_pb2.TopLogprobs]]:
        """The logprobs and top alternatives of a drafted row's emitted tokens: its kept drafts', then its
        token's."""
        result, k, n = self.result, seq.info.sampling.logprobs, self.num_top
        logprobs: list[float] = []
        top: list[common_pb2.TopLogprobs] = []
        for j in range(first_draft, first_draft + num_drafts):
            if self.draft_logprobs:
                logprobs.append(self.draft_logprobs[j])
            if n and k:
                top.append(common_pb2.TopLogprobs(token_ids=result.accepted_draft_top_token_ids[j * n:(j + 1) * n][:k],
                                                  logprobs=result.accepted_draft_top_logprobs[j * n:(j + 1) * n][:k]))
        if with_token:
            if self.logprobs:
                logprobs.append(self.logprobs[row])
            if n and k:
                top.append(common_pb2.TopLogprobs(token_ids=result.top_token_ids[row * n:(row + 1) * n][:k],
                                                  logprobs=result.top_logprobs[row * n:(row + 1) * n][:k]))
        return logprobs, top


def collect_prompt_logprobs(result: worker_pb2.StepResult, sequences: dict[int, Sequence],
                            store: dict[int, PromptLogprobs]) -> None:
    """File the step's prompt-logprob entries by their sequences (before the step's first tokens go out)."""
    for entry in result.prompt_logprobs:
        seq = sequences.get(entry.seq_id)
        if seq is not None and seq.needs_prompt_logits:
            scored = store.get(seq.seq_id)
            if scored is None:
                scored = store[seq.seq_id] = PromptLogprobs(seq.info.prompt_len)
            scored.add(entry)


def finish_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> int:
    """Why `seq` ends with the token just sampled (FINISH_REASON_UNSPECIFIED: it goes on)."""
    s = seq.info.sampling
    num_tokens = len(seq.token_ids)
    # min_tokens: the worker masks EOS and stop ids until then; this check is the second line of defence.
    if ((token in eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids) and \
            num_tokens - seq.info.prompt_len > s.min_tokens:
        return common_pb2.FINISH_REASON_STOP
    if num_tokens - seq.info.prompt_len >= s.max_tokens or num_tokens >= max_model_len:
        return common_pb2.FINISH_REASON_LENGTH
    return common_pb2.FINISH_REASON_UNSPECIFIED
