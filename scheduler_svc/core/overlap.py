"""Overlap (async scheduling): planning step N+1 while the worker computes step N.

The replica sends step N, then plans step N+1 before N's result is back and sends it too, marked
`after_step_id = N` (the worker runs it right after N). The worker then goes from one step to the
next without waiting for a round trip through the scheduler, and the scheduler's own work (applying
results, publishing tokens, planning) happens while the model computes.

Planning ahead assumes step N's outcome (`StepInFlight.assume`): every token N computes counts as
computed (its full blocks go to the prefix cache), and every sequence N samples for gets a
placeholder token at the end of `token_ids`, which N+1 decodes: the worker appended the real token
itself when it sampled it. When N's result arrives, `Scheduler.process_result` puts each token in its
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

from scheduler_svc.core.step_plan import disarm
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus

PREFILL, DECODE = SequenceStatus.PREFILL, SequenceStatus.DECODE
PLACEHOLDER = -1  # a token id no vocabulary has: never sent to a worker (admission waits for the real one)


class StepInFlight:
    """The last plan's entries until they count as computed, and the step planned ahead of (if any).

    The fast decodes are not among `entries` (`Scheduler.schedule`): a decode's count is brought up
    to date when its token comes back (`ResultReader`), and it fills no block."""

    __slots__ = ("entries", "assumed_step", "drafted")

    def __init__(self) -> None:
        self.entries: list[tuple[Sequence, int]] = []  # (sequence, tokens it computes), in plan order
        self.assumed_step = 0  # the last step planned ahead of: its result's tokens are already counted
        self.drafted: list[Sequence] = []  # its decodes with speculative drafts (speculation/speculation.py)

    def record(self, entries: list[tuple[Sequence, int]], drafted: list[Sequence]) -> None:
        """The plan just made is the step in flight (`drafted`: its entries with drafts, counted as their one
        certain token in `entries`)."""
        self.entries, self.drafted = entries, drafted

    def counted(self, step_id: int) -> bool:
        """Whether step `step_id`'s tokens were counted when the next step was planned ahead of it."""
        return step_id == self.assumed_step

    def may_plan_ahead(self, step_id: int) -> bool:
        """Whether the step after `step_id` (the one in flight) may be planned before its result: not
        when it was itself planned ahead of already, nor when a prompt in it forks (the forks take
        their blocks from the prompt's once its token is back), nor when a decode in it has drafts (it may
        add several tokens, where planning ahead assumes one)."""
        return (self.assumed_step != step_id and not self.drafted
                and not any(seq.pending_forks for seq, _ in self.entries))

    def count(self, kv_cache: KVCacheManager) -> None:
        """The entries as computed, full blocks offered to the prefix cache, in plan order: when the step's
        result arrives, before any row frees blocks, or when the next step is planned ahead of it."""
        for seq, n in self.entries:
            status = seq.status
            if status is DECODE or status is PREFILL:  # not finished, preempted or swapped meanwhile
                seq.num_computed += n
        kv_cache.register_computed(self.entries)  # in plan order; each reads only its own count
        self.entries = []

    def assume(self, step_id: int, running: list[Sequence], kv_cache: KVCacheManager, max_model_len: int) -> None:
        """Take step `step_id` (in flight) as done: tokens computed, a placeholder for each token it samples."""
        self.count(kv_cache)  # its entries but the fast decodes, as a result counts them
        self.assumed_step = step_id
        last_model_len = max_model_len - 1
        for seq in running:
            if seq.last_scheduled_step != step_id:
                continue
            token_ids = seq.token_ids
            num = len(token_ids)
            if seq.num_computed == num - 1 and seq.status is DECODE:  # a fast decode (not in `entries`)
                seq.num_computed = num
            elif seq.num_computed != num or seq.info.pooling:
                continue  # a prompt chunk that is not the last (nothing sampled), or an embedding's (ends with it)
            token_ids.append(PLACEHOLDER)
            seq.awaiting_token = True
            seq.status = DECODE
            if num >= seq.last_len or num >= last_model_len:
                # The token N samples ends the sequence by length: nothing more to plan for it
                # (schedule() skips a decode with nothing left to compute).
                seq.num_computed = num + 1
                disarm(seq)

    def take_drafted(self) -> list[Sequence]:
        """The step's decodes with drafts, once its result is read (their blocks past their tokens to free)."""
        drafted, self.drafted = self.drafted, []
        return drafted

    def forget_assumed(self) -> bool:
        """The step planned ahead of will not be answered (a failed step): whether there was one, whose
        blocks were offered to the prefix cache before it ran."""
        assumed, self.assumed_step = self.assumed_step, 0
        return bool(assumed)

    def clear(self) -> None:
        """The worker's state is void: nothing in flight, nothing assumed."""
        self.entries, self.drafted = [], []
        self.assumed_step = 0


def drop_placeholders(seqs: list[Sequence]) -> None:
    """The step in flight is lost (its worker failed): its tokens never come; the sequences are
    recomputed from the tokens they have."""
    for seq in seqs:
        if seq.awaiting_token:
            seq.token_ids.pop()
            seq.awaiting_token = False
