"""One sequence's speculative-decoding state (scheduler_svc/speculation/speculation.py): the n-gram index its proposals
come from, how long its next proposal may be, and its back-off after drafts that failed."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.speculation.ngram_proposer import NgramIndex

MAX_BACK_OFF = 64  # decodes a sequence whose drafts keep failing waits at most before it proposes again


@dataclass(slots=True)
class DraftState:
    """One sequence's speculation: its n-gram index, how long its next proposal may be, and its back-off."""

    index: NgramIndex
    max_drafts: int  # its next proposal's length at most
    drafted_at: int = 0  # its token count when its last drafts were sent
    proposed: int = 0  # how many those were
    acceptance: float = 1.0  # the share of its drafts it keeps, a running average (from 1.0 or a prior)
    misses: int = 0  # drafted decodes in a row that kept none
    resume_at: int = 0  # the token count before which it proposes nothing

    def drafted_for(self, num_tokens: int) -> bool:
        """Whether drafts were sent for the decode of the sequence's `num_tokens`-th token."""
        return self.proposed > 0 and self.drafted_at == num_tokens

    def kept(self, num_kept: int, num_tokens: int, limit: int) -> None:
        """A drafted decode kept `num_kept` drafts; the sequence now holds `num_tokens` tokens."""
        self.acceptance = 0.5 * self.acceptance + 0.5 * num_kept / max(self.proposed, 1)
        self.proposed = 0  # settled
        self.max_drafts = min(limit, num_kept + 1)
        self.misses = 0 if num_kept else self.misses + 1
        if self.misses:
            self.resume_at = num_tokens + min(MAX_BACK_OFF, 2**self.misses)
