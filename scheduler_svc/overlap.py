"""Overlap (async scheduling): planning step N+1 while the worker computes step N.

The replica sends step N, then plans step N+1 before N's result is back and sends it too, marked
`after_step_id = N` (the worker runs it right after N). The worker then goes from one step to the
next without waiting for a round trip through the scheduler, and the scheduler's own work (applying
results, publishing tokens, planning) happens while the model computes.

Planning ahead assumes step N's outcome (`assume_in_flight`): every token N computes counts as
computed (its full blocks go to the prefix cache), and every sequence N samples for gets a
placeholder token at the end of `token_ids`, which N+1 decodes: the worker appended the real token
itself when it sampled it. When N's result arrives, `process_result` puts each token in its
placeholder's place (`Sequence.awaiting_token`) and checks it as usual. A sequence that N ends by
its length is known beforehand and is not planned again; one that N ends with EOS or a stop id had
one token computed in vain by N+1, dropped with the sequence (its blocks freed, the worker told in
the next plan). Each sequence computes the same tokens in the same order as without overlap, so
greedy output is unchanged.

A sequence with a placeholder may be preempted by N+1's plan (its token still comes back with N's
result); it is not re-admitted or swapped in until then. Planning ahead waits for N's result when N
completes a prompt that forks into several samples (n > 1): the forks take their blocks from it.
"""

from __future__ import annotations

from typing import Protocol

from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.token_output import count_in_flight

DECODE = SequenceStatus.DECODE
PLACEHOLDER = -1  # a token id no vocabulary has: never sent to a worker (admission waits for the real one)


class Scheduler(Protocol):
    """What planning ahead touches of the Scheduler (scheduler.py; not imported: it imports this module)."""

    running: list[Sequence]
    kv_cache: KVCacheManager
    block_size: int
    max_model_len: int
    step_id: int
    suspended: bool
    _in_flight: list[tuple[Sequence, int]]
    _assumed_step: int


def can_plan_ahead(s: Scheduler) -> bool:
    """Whether the next step may be planned before the result of the one in flight (`s.step_id`)."""
    return (not s.suspended and s._assumed_step != s.step_id
            and not any(seq.pending_forks for seq, _ in s._in_flight))


def assume_in_flight(s: Scheduler) -> None:
    """Take the step in flight as done: tokens computed, a placeholder for each token it samples."""
    step = s.step_id
    count_in_flight(s)  # its entries but the fast decodes, as process_result counts them
    s._assumed_step = step
    last_model_len = s.max_model_len - 1
    for seq in s.running:
        if seq.last_scheduled_step != step:
            continue
        token_ids = seq.token_ids
        num = len(token_ids)
        if seq.num_computed == num - 1 and seq.status is DECODE:  # a fast decode (not in _in_flight)
            seq.num_computed = num
        elif seq.num_computed != num:
            continue  # a prompt chunk that is not the last: nothing sampled
        token_ids.append(PLACEHOLDER)
        seq.awaiting_token = True
        seq.status = DECODE
        if num >= seq.last_len or num >= last_model_len:
            # The token N samples ends the sequence by length: nothing more to plan for it
            # (schedule() skips a decode with nothing left to compute).
            seq.num_computed = num + 1
            seq.fast_until = 0


def drop_placeholders(seqs: list[Sequence]) -> None:
    """The step in flight is lost (its worker failed): its tokens never come; the sequences are
    recomputed from the tokens they have."""
    for seq in seqs:
        if seq.awaiting_token:
            seq.token_ids.pop()
            seq.awaiting_token = False
