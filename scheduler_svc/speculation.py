"""Speculative decoding on the scheduler's side (issue 40, config `speculative_method`): which decodes get
proposals, the proposals (scheduler_svc/ngram_proposer.py), and the counts.

A decode with proposals d_1..d_k is scheduled as 1 + k tokens (its last token, then the drafts) and its entry
carries them (ScheduledSequence.draft_token_ids); it is written on the general path, never the fast one. The
worker scores the k + 1 positions and keeps the longest prefix of drafts its own greedy choices agree with,
then its own token (gpu_worker/draft_rows.py), so the output is token for token what decoding without
speculation gives. Only the token certainly computed counts as computed when the step is counted
(overlap.StepInFlight.count); the kept drafts are counted as the result is read (result_reader.py), so
prefix-cache registration never sees a rejected one, and the blocks allocated past the sequence's tokens
are freed then (`KVCacheManager.trim`, the worker trimming its table the same way). A step with drafts
is not planned ahead of (overlap.py assumes one token per decode).

Eligible today: greedy samples without logits controls, logprobs or a constraint (the others decode
one token a step, unchanged).
"""

from __future__ import annotations

from hetero_common.config import Config
from hetero_common.sampling import Sampling
from scheduler_svc.kv_cache_manager import CopiedBlock, KVCacheManager
from scheduler_svc.ngram_proposer import NgramIndex
from scheduler_svc.sequence import Sequence


def eligible(sampling: Sampling) -> bool:
    """Whether a sample's decodes may carry proposals (those the worker verifies greedily, as they are)."""
    return sampling.temperature == 0 and not sampling.uses_sampler_controls and sampling.logprobs is None


class Speculator:
    """The proposals for each decode, and how many were proposed and kept (the scheduler's metrics)."""

    __slots__ = ("max_drafts", "min_n", "max_n", "max_model_len", "num_proposed", "num_accepted", "num_drafted_rows")

    def __init__(self, config: Config, max_model_len: int) -> None:
        self.max_drafts = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.num_proposed = 0  # draft tokens sent to the worker
        self.num_accepted = 0  # of those, kept
        self.num_drafted_rows = 0  # decodes that carried drafts

    def drafts(self, seq: Sequence, token_budget: int, kv_cache: KVCacheManager) -> list[int]:
        """Proposals for a `speculative` decode computing its last token this step: at most `token_budget`, no
        more than its max_tokens and max_model_len leave room for (the step emits up to 1 + k tokens), and
        only where the free blocks hold them (drafts never preempt anyone)."""
        if seq.awaiting_token:
            return []
        token_ids = seq.token_ids
        room = min(self.max_drafts, token_budget, seq.last_len - len(token_ids), self.max_model_len - 1 - len(token_ids))
        if room <= 0:
            return []
        index = seq.ngram
        if index is None:
            index = seq.ngram = NgramIndex(self.min_n, self.max_n)
        if len(index) > len(token_ids):  # never: token ids only grow (a placeholder is never indexed)
            index.truncate(len(token_ids))
        index.extend(token_ids[len(index):])
        drafts = index.propose(room)
        if drafts and not kv_cache.can_grow(seq, 1 + len(drafts)):
            return []
        if drafts:
            self.num_proposed += len(drafts)
            self.num_drafted_rows += 1
        return drafts

    def allocate(self, seq: Sequence, token_budget: int,
                 kv_cache: KVCacheManager) -> tuple[list[CopiedBlock] | None, list[int]]:
        """A `speculative` decode's blocks, for its last token and its drafts, within `token_budget` tokens:
        (the copies to make, or None when the pool is short (for the caller to preempt for the token alone),
        the drafts). Drafts never preempt anyone: where copy-on-write finds no block for them, they are dropped
        and the blocks taken for them freed."""
        drafts = self.drafts(seq, token_budget - 1, kv_cache)
        copies = kv_cache.allocate_slots(seq, 1 + len(drafts))
        if copies is None and drafts:
            kv_cache.trim(seq, seq.num_computed + 1)
            self.num_proposed -= len(drafts)
            self.num_drafted_rows -= 1
            drafts = []
        return copies, drafts

    def settle(self, drafted: list[Sequence], num_accepted: int, kv_cache: KVCacheManager) -> None:
        """After a step's result is read: the blocks of the drafts the worker rejected freed (the worker drops
        them from its tables by the same rule), the kept ones counted."""
        for seq in drafted:
            if not seq.status.finished:
                kv_cache.trim(seq, len(seq.token_ids))
        self.num_accepted += num_accepted
