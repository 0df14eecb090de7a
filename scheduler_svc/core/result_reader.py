"""A step's result read into the sequences it sampled for: each token appended to its sequence (or put
in its placeholder's place, overlap.py), checked against the sequence's stop conditions and turned into
the sample's output (token_output.py).

What follows for the scheduler is reported, not done here: the samples whose prompt is now computed
and that fork the request's other samples, and the samples that ended, in row order (`StepRead`).
`Scheduler.process_result` carries them out: it owns the queues, the request table and the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hetero.v1 import common_pb2, worker_pb2
from scheduler_svc.core.prompt_logprobs import PromptLogprobs
from scheduler_svc.core.token_output import SampledRows, StepOutputs, TokenOutput, finish_reason
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.speculation.speculation import Speculator

PREFILL, DECODE = SequenceStatus.PREFILL, SequenceStatus.DECODE
COMPLETED, FAILED = SequenceStatus.COMPLETED, SequenceStatus.FAILED  # tested with `is`
LENGTH, ERROR, STOP = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_STOP


class StepRead:
    """One result read: the outputs, and what the scheduler is to do about its sequences."""

    __slots__ = ("outputs", "forks", "ends", "drafts_accepted")

    def __init__(self, now: float) -> None:
        self.outputs = StepOutputs(now)
        self.forks: list[Sequence] = []  # samples whose prompt is computed: they fork the request's others
        # (sample, status, ran): in row order (the finish reason is in its output). `ran`: it was in `running` for
        # this step and is taken off it with the others once all are ended; else it is taken off whichever queue
        # holds it.
        self.ends: list[tuple[Sequence, SequenceStatus, bool]] = []
        self.drafts_accepted = 0  # speculative drafts the worker kept (those after a stop included)


class ResultReader:
    """Reads StepResults against the stop conditions: EOS and stop ids, max_tokens, max_model_len. It keeps
    each sample's prompt logprobs until its first output carries them (`prompt_logprobs`, by seq id)."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int, speculator: Speculator | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._speculator = speculator  # the drafting state of the rows that carried drafts
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # seq id -> its prompt logprobs so far
        # Every token id that may end a sequence: EOS and any request's stop ids (it only grows). A sampled
        # token outside it ends a sequence by length alone, which `read` checks inline.
        self._maybe_stop_ids = set(eos_token_ids)

    def watch_stop_ids(self, stop_token_ids: Iterable[int]) -> None:
        """A request with these stop ids is in flight."""
        self._maybe_stop_ids.update(stop_token_ids)

    def forget(self, seq: Sequence) -> None:
        """The sample ended: prompt logprobs it never delivered go."""
        self.prompt_logprobs.pop(seq.seq_id, None)

    def read(self, result: worker_pb2.StepResult, sequences: dict[int, Sequence]) -> StepRead:
        """Apply one step's sampled tokens to their sequences (found by seq id; a row whose sequence is gone
        was aborted while the step ran); every token before a sampled one counts as computed.

        The common step, tokens only, takes a fast path: a decode's token that is no stop or EOS id, not its
        sequence's first output, is appended here; under its length limits it goes into the outputs' columns,
        at them it ends the sequence by length (what `_read_row` would find). Any other row, and every row of
        a step with logprobs, prompt logprobs or failed samples, takes the general path (`_read_row`)."""
        step = StepRead(time.time())
        if result.embeddings:
            _read_embeddings(result, sequences, step)
        if (result.failures or result.logprobs or result.num_top_logprobs or result.prompt_logprobs
                or result.num_accepted_drafts):
            self._read_rows(result, sequences, step)
            return step
        outputs, now, ends = step.outputs, step.outputs.timestamp, step.ends
        add_seq, add_token = outputs.seqs.append, outputs.tokens.append
        maybe_stop = self._maybe_stop_ids
        rows = None
        for seq, token in zip(map(sequences.get, result.seq_ids), result.token_ids):
            if seq is None:
                continue
            if seq.status is DECODE and seq.first_output_sent and token not in maybe_stop:
                token_ids = seq.token_ids
                if seq.awaiting_token:  # planned ahead (overlap.py): the token takes its placeholder's place
                    num = len(token_ids) - 1
                    token_ids[num] = token
                    seq.awaiting_token = False
                else:  # a fast decode's computed count is brought up to date here (its step counted no entry)
                    seq.num_computed = num = len(token_ids)
                    token_ids.append(token)
                if num < seq.last_len:  # under max_tokens and max_model_len (`Sequence.cap_length`)
                    add_seq(seq)
                    add_token(token)
                else:
                    outputs.add(TokenOutput(seq.info.request_id, [token], LENGTH, timestamp=now, index=seq.info.index))
                    ends.append((seq, COMPLETED, True))
                continue
            if rows is None:
                rows = SampledRows(result, self.prompt_logprobs)
            self._read_row(seq, token, 0, rows, step)  # the row index: for logprobs, none here
        return step

    def _read_rows(self, result: worker_pb2.StepResult, sequences: dict[int, Sequence], step: StepRead) -> None:
        """Every row through `_read_row`: a step with logprobs, prompt logprobs, failed samples or speculative
        drafts (a row's kept drafts come before its token: `_read_drafted_row`)."""
        rows = SampledRows(result, self.prompt_logprobs, sequences)  # files the step's prompt logprobs first
        speculator = self._speculator
        failures = {f.seq_id: f.error for f in result.failures}
        counts, kept_ids, first_kept = result.num_accepted_drafts, result.accepted_draft_ids, 0
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
            kept = list(kept_ids[first_kept:first_kept + counts[i]]) if counts else None
            first_kept += len(kept or ())
            seq = sequences.get(seq_id)
            if seq is None:
                continue  # aborted while the step ran
            if failures and seq_id in failures:  # e.g. the worker could not apply this sample's constraint
                if seq.status is not COMPLETED and seq.status is not FAILED:
                    step.ends.append((seq, FAILED, False))
                    step.outputs.add(TokenOutput(seq.info.request_id, finish_reason=ERROR, index=seq.info.index,
                                                 error=f"this sample failed on the worker: {failures[seq_id]}"))
                continue
            # a decode drafted in this step, kept drafts or not (a sequence whose drafted step was lost, recomputed
            # since, is no decode when its length comes round again)
            drafting = speculator.state_of(seq) if speculator is not None and kept is not None else None
            if kept or (drafting is not None and seq.status is DECODE and drafting.drafted_for(len(seq.token_ids))):
                self._read_drafted_row(seq, kept, token, i, rows, step, first_kept - len(kept))
            else:
                self._read_row(seq, token, i, rows, step)

    def _read_drafted_row(self, seq: Sequence, kept: list[int], token: int, row: int, rows: SampledRows,
                          step: StepRead, first_kept: int) -> None:
        """A decode whose drafts the worker verified (speculation/speculation.py): its kept drafts, then its
        own token, each applied as if sampled alone (computed before the next, the stop conditions checked
        after it); the run is cut after the first token that ends the sequence, as decoding one at a time
        would have stopped there. One output carries them."""
        if seq.status is not DECODE:
            return  # aborted while the step ran (a drafted step is never planned ahead of: nothing else moves it)
        step.drafts_accepted += len(kept)
        emitted: list[int] = []
        reason = common_pb2.FINISH_REASON_UNSPECIFIED
        for t in (*kept, token):
            seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(t)
            emitted.append(t)
            reason = finish_reason(seq, t, self.eos_token_ids, self.max_model_len)
            if reason:
                break
        out = rows.output(seq, token, row, step.outputs.timestamp, reason, emitted, first_kept, len(kept))
        drafting = self._speculator.state_of(seq) if self._speculator is not None else None
        if drafting is not None:  # the request's usage counts its drafts (Usage.speculative_*)
            out.draft_tokens, out.accepted_drafts = drafting.proposed, len(kept)
        step.outputs.add(out)
        if reason:
            step.ends.append((seq, COMPLETED, True))

    def _read_row(self, seq: Sequence, token: int, row: int, rows: SampledRows, step: StepRead) -> None:
        """Apply one sampled token to its sequence and add its output (and its fork or end, if any)."""
        status = seq.status
        if status is COMPLETED or status is FAILED:
            return  # aborted while the step ran
        if seq.pending_forks:
            step.forks.append(seq)
        ran = status is PREFILL or status is DECODE  # the statuses in `running`
        if seq.awaiting_token:  # planned ahead (overlap.py): counted then; preempted since, it stays where it is
            seq.token_ids[-1] = token
            seq.awaiting_token = False
        else:
            if ran:  # every token before the sampled one is computed (a fast decode's count: `read`)
                seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(token)
            seq.status = DECODE
        reason = finish_reason(seq, token, self.eos_token_ids, self.max_model_len)
        step.outputs.add(rows.output(seq, token, row, step.outputs.timestamp, reason))
        if reason:
            step.ends.append((seq, COMPLETED, ran))


def _read_embeddings(result: worker_pb2.StepResult, sequences: dict[int, Sequence], step: StepRead) -> None:
    """The embedding sequences whose prompt the step completed: each ends (STOP) with its pooled vector as its
    one output; none samples a token."""
    for pooled in result.embeddings:
        seq = sequences.get(pooled.seq_id)
        if seq is None or seq.status is not PREFILL:
            continue  # aborted while the step ran
        seq.first_output_sent = True
        step.outputs.add(TokenOutput(seq.info.request_id, (), STOP, timestamp=step.outputs.timestamp,
                                     queue_seconds=seq.queue_seconds or 0.0, index=seq.info.index,
                                     embedding=pooled.values))
        step.ends.append((seq, COMPLETED, True))
