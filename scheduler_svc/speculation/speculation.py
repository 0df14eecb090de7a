"""Speculative decoding on the scheduler's side (issue 40, config `speculative_method`): which decodes get
proposals, the proposals (scheduler_svc/speculation/ngram_proposer.py), and the counts.

A decode with proposals d_1..d_k is scheduled as 1 + k tokens (its last token, then the drafts) and its entry
carries them (ScheduledSequence.draft_token_ids), or, with a draft model (`draft`), how many the worker's
draft model is to propose (num_draft_model_tokens: gpu_worker/models/draft_model.py); it is written on the general
path, never the fast one. The worker samples the k + 1 positions as decoding one at a time would and keeps the
longest prefix of drafts equal to those samples, then its own token (gpu_worker/sampling/draft_rows.py), so the output
is token for token what decoding without speculation gives (greedy; seeded sampling; unseeded, the same
distribution: for a proposer that picks its drafts, greedily or by lookup, keeping a draft x exactly when the
sample is x is the rejection rule of Leviathan et al.). Only the token certainly computed counts as computed
when the step is counted (overlap.StepInFlight.count); the kept drafts are counted as the result is read (result_reader.py), so
prefix-cache registration never sees a rejected one, and the blocks allocated past the sequence's tokens
are freed then (`KVCacheManager.trim`, the worker trimming its table the same way). A step with drafts
is not planned ahead of (overlap.py assumes one token per decode).

Every sample may carry drafts: greedy or sampled, with logits controls, logprobs and structured output (each
position is sampled with its own history and its grammar's state after the drafts before it, and the matcher
consumes only what is kept: gpu_worker/sampling/draft_rows.py).

Adaptive, so that it does not cost throughput. Per sequence: after a drafted decode that kept `a` drafts,
its next proposal is at most a + 1 tokens long (growing back by one per success); one that kept none also
waits 2, 4, 8 ... up to 64 decodes before it proposes again (draft_state.py). Per step: a sequence proposes
only while the share of its drafts it keeps (a running average) exceeds the share the step's cost needs,
which grows with the batch as the worker's steps turn compute-bound, and with what a draft model's tokens
cost (step_cost.py, measured). Until that cost is measured, one sequence a step drafts with a draft model, and
a new sequence starts from the share recent drafts kept (one in EXPLORE from 1.0).
`speculative_adaptive: false` turns all of this off: every decode proposes num_speculative_tokens.
"""

from __future__ import annotations

from hetero.v1 import worker_pb2
from hetero_common.config import Config
from scheduler_svc.kv.kv_cache_manager import CopiedBlock, KVCacheManager
from scheduler_svc.sequence import Sequence
from scheduler_svc.speculation.draft_state import DraftState
from scheduler_svc.speculation.ngram_proposer import NgramIndex
from scheduler_svc.speculation.step_cost import StepCostModel

EXPLORE = 16  # with a draft model, one new sequence in this many starts optimistic


class Speculator:
    """The proposals for each decode, and how many were proposed and kept (the scheduler's metrics)."""

    __slots__ = ("max_drafts", "min_n", "max_n", "max_model_len", "num_proposed", "num_accepted", "num_drafted_rows",
                 "cost", "draft_model", "adaptive", "acceptance", "_rows_before_step", "_num_states", "_states")

    def __init__(self, config: Config, max_model_len: int) -> None:
        self.draft_model = config.speculative_method == "draft"  # proposals from the worker's draft model
        self.max_drafts = config.num_speculative_tokens
        self.adaptive = config.speculative_adaptive
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.num_proposed = 0  # draft tokens sent to the worker
        self.num_accepted = 0  # of those, kept
        self.num_drafted_rows = 0  # decodes that carried drafts
        self.cost = StepCostModel()  # what drafts cost the worker's steps at the current batch
        self._rows_before_step = 0  # num_drafted_rows when the step being planned began
        self.acceptance = 1.0  # the share of drafts kept, a running average over drafted steps
        self._num_states = 0  # sequences that have had a draft state
        self._states: dict[int, DraftState] = {}  # seq id -> its drafting, from its first proposal to its end

    def drafts(self, seq: Sequence, token_budget: int, kv_cache: KVCacheManager) -> tuple[list[int], int]:
        """Proposals for a `speculative` decode computing its last token this step: (n-gram drafts, or how many
        the worker's draft model is to propose). At most `token_budget`, no more than its max_tokens and
        max_model_len leave room for (the step emits up to 1 + k tokens), and only where the free blocks hold
        them (drafts never preempt anyone)."""
        if seq.awaiting_token:
            return [], 0
        token_ids = seq.token_ids
        state = self._state(seq)
        num = len(token_ids)
        limit = state.max_drafts if self.adaptive else self.max_drafts
        room = min(limit, token_budget, seq.last_len - num, self.max_model_len - 1 - num)
        if room <= 0:
            return [], 0
        if self.adaptive and (num < state.resume_at or state.acceptance <= self.cost.threshold() or (
                self.draft_model and not self.cost.measured() and self.num_drafted_rows > self._rows_before_step)):
            return [], 0  # (a draft model: one probe a step until what its tokens cost is measured)
        drafts: list[int] = []
        if not self.draft_model:
            state.index.extend(token_ids[len(state.index):])
            drafts = state.index.propose(room)
        count = room if self.draft_model else len(drafts)
        if not count or not kv_cache.can_grow(seq, 1 + count):
            return [], 0
        state.drafted_at, state.proposed = num, count
        self.num_proposed += count
        self.num_drafted_rows += 1
        return drafts, count - len(drafts)

    def allocate(self, seq: Sequence, token_budget: int,
                 kv_cache: KVCacheManager) -> tuple[list[CopiedBlock] | None, list[int], int]:
        """A `speculative` decode's blocks, for its last token and its drafts, within `token_budget` tokens:
        (the copies to make, or None when the pool is short (for the caller to preempt for the token alone),
        the n-gram drafts, how many the draft model proposes). Drafts never preempt anyone: where copy-on-write
        finds no block for them, they are dropped and the blocks taken for them freed."""
        drafts, asked = self.drafts(seq, token_budget - 1, kv_cache)
        count = len(drafts) + asked
        copies = kv_cache.allocate_slots(seq, 1 + count)
        if copies is None and count:
            kv_cache.trim(seq, seq.num_computed + 1)
            self.num_proposed -= count
            self.num_drafted_rows -= 1
            self._state(seq).proposed = 0
            drafts, asked = [], 0
        return copies, drafts, asked

    def wants_drafts(self, running: list[Sequence]) -> bool:
        """Whether a running decode may propose in the next step: then it is not planned ahead of the step in
        flight (overlap.py's placeholders leave nothing to look up), and speculation takes overlap's place."""
        threshold = self.cost.threshold()
        for seq in running:
            if seq.speculative and not seq.awaiting_token:
                state = self._state(seq)
                if not self.adaptive or (len(seq.token_ids) + 1 >= state.resume_at and state.acceptance > threshold):
                    if self.draft_model:  # it proposes at every decode
                        return True
                    state.index.extend(seq.token_ids[len(state.index):])
                    if state.index.propose(1):  # its text repeats here: the next token likely continues it
                        return True
        return False

    def state_of(self, seq: Sequence) -> DraftState | None:
        """The sequence's drafting state (None: it has proposed nothing yet)."""
        return self._states.get(seq.seq_id)

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: its drafting state goes."""
        self._states.pop(seq.seq_id, None)

    def _state(self, seq: Sequence) -> DraftState:
        state = self._states.get(seq.seq_id)
        if state is None:
            # A draft model's first proposal costs a pass over the prompt: a new sequence starts from what recent
            # drafts kept, but one in EXPLORE from the optimistic 1.0, so that a workload it suits is found.
            # (Lookups cost nothing to try: every sequence starts optimistic.)
            self._num_states += 1
            explore = not self.draft_model or self._num_states % EXPLORE == 1
            state = self._states[seq.seq_id] = DraftState(NgramIndex(self.min_n, self.max_n), self.max_drafts,
                                                          acceptance=1.0 if explore else self.acceptance)
        return state

    def planned(self, step_id: int, num_tokens: int, num_running: int) -> None:
        """A step was planned: its tokens, for its cost once its result says how long it took."""
        self.cost.planned(step_id, num_tokens, num_running)
        self._rows_before_step = self.num_drafted_rows

    def settle(self, drafted: list[Sequence], num_accepted: int, kv_cache: KVCacheManager,
               result: worker_pb2.StepResult) -> None:
        """After a step's result is read: the blocks of the drafts the worker rejected freed (the worker drops
        them from its tables by the same rule), the kept ones counted, the step's time measured."""
        states = self._states
        proposed = sum(states[seq.seq_id].proposed for seq in drafted if seq.seq_id in states)
        self.cost.observe(result.step_id, result.forward_seconds, result.draft_seconds, result.draft_proposal_seconds,
                          proposed if self.draft_model else 0)
        if proposed:
            self.acceptance = 0.8 * self.acceptance + 0.2 * num_accepted / proposed
        for seq in drafted:
            state = states.get(seq.seq_id)
            if not seq.status.finished and state is not None:
                kv_cache.trim(seq, len(seq.token_ids))
                # every token but the last is computed: the one the decode computed for sure, and the drafts kept
                state.kept(seq.num_computed - state.drafted_at, len(seq.token_ids), self.max_drafts)
        self.num_accepted += num_accepted
