"""Speculative drafts on the worker (issue 40; the scheduler's side: scheduler_svc/speculation/speculation.py).

A scheduled decode with drafts d_1..d_k computes its last token and the drafts in one chunk of k + 1 rows,
like a short prompt chunk at the end of its cache. Row j's logits score the token after input j, so every
row is sampled, as the token at output index num_generated + j (its seeded noise that index's): row j's
choice is what decoding one token at a time would pick after d_1..d_j, given that those were the tokens. The
sequence keeps the longest run of drafts equal to those choices, then the choice at the first mismatch (or
after the last draft): gpu_worker/speculative_verify.verify_greedy. Greedy and seeded outputs are therefore
those of decoding without speculation, the same bits where the kernels are row invariant (`deterministic`,
docs/configuration.md), and unseeded ones follow the same distribution. For a proposer without a
distribution (n-gram lookup) this keeps a draft x with probability p(x), what the rejection rule of
speculative_verify.verify_sampled keeps too, so nothing is lost by matching. Logits controls (penalties,
logit_bias, min_tokens) see each row's own history (`DraftRow`), and so does a constraint: row j is masked
by the grammar's state after d_1..d_j, and the matcher consumes only what the sequence keeps
(gpu_worker/sampling/constrained.py); a kept draft's logprobs are its own row's (`pack`).

After the step the sequence holds its kept drafts and its own token; the K/V of the kept drafts is computed,
that of the rejected ones is left in slots the next tokens overwrite, and the blocks past the sequence's
tokens leave its table, as the scheduler frees them (KVCacheManager.trim).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from gpu_worker.sampling.constrained import GuidanceVocabulary, RowConstraint, advance_drafted, ensure_constraint
from gpu_worker.sampling.logits_processors import RowControls, build_row_controls
from gpu_worker.sampling.sampler import top_logprobs
from gpu_worker.sampling.speculative_verify import verify_greedy
from hetero.v1 import worker_pb2
from hetero_common.errors import ExecutionError
from hetero_common.sampling import Sampling


class DraftedState(Protocol):  # step_io.SequenceState's fields used here
    token_ids: list[int]
    sampling: Sampling
    num_generated: int
    num_computed: int
    block_table: np.ndarray
    controls: RowControls | None
    constraint: RowConstraint | None


def check_drafts(seq_id: int, sample: bool, drafts: Sequence[int], end: int, known: int) -> None:
    """A plan's drafts are for a sampled row that computes the sequence's last token and the drafts (`end`: its
    computed length after the step; `known`: its tokens)."""
    if not sample:
        raise ExecutionError(f"sequence {seq_id} has draft tokens but is not sampled this step")
    if end != known + len(drafts):
        raise ExecutionError(f"sequence {seq_id} has {len(drafts)} draft tokens, but the step computes up to {end} "
                             f"of its {known} tokens: drafts follow the last token")


def logits_rows(qo_indptr: torch.Tensor, sample_idx: list[int], drafts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """The flattened tokens' rows to score: each sampling sequence's last row, or its last k + 1 with k drafts;
    and where each sequence's rows start among them (one more entry: the total)."""
    ends = qo_indptr[1:].to(torch.int64)[sample_idx].tolist()
    rows: list[int] = []
    starts = [0]
    for end, d in zip(ends, drafts):
        rows.extend(range(end - 1 - len(d), end))
        starts.append(len(rows))
    return torch.tensor(rows, dtype=torch.int64), starts


@dataclass
class DraftRow:
    """Row j of a drafted sequence as the sampler sees it: the sequence as it would be after drafts d_1..d_j.
    `token_ids` is the sequence's own (no control reads it once `controls` is built); `controls`, where it
    has logits controls, a copy counting d_1..d_j too, so that penalties and min_tokens apply at every
    position as decoding one at a time would (the sequence's own controls record only what it keeps)."""

    sampling: Sampling
    token_ids: list[int]
    num_generated: int  # the output index this row samples
    controls: RowControls | None = None
    constraint: RowConstraint | None = None  # the sequence's matcher, masked as after `draft_prefix`
    draft_prefix: list[int] | None = None  # d_1..d_j


def expand(states: list, drafts: list[list[int]], vocab_size: int, eos_token_ids: Sequence[int],
           device: torch.device, vocabulary: GuidanceVocabulary | None = None) -> list:
    """The sampling batch's rows: each sequence without drafts itself, a drafted one as a `DraftRow` per
    scored row. `vocabulary`: llguidance's (constrained sequences)."""
    rows: list = []
    for st, d in zip(states, drafts):
        if not d:
            rows.append(st)
            continue
        if st.sampling.uses_logits_controls and st.controls is None:
            st.controls = build_row_controls(st.sampling, st.token_ids, st.num_generated, vocab_size, eos_token_ids,
                                             device)
        constraint = ensure_constraint(st, vocabulary) if st.sampling.constraint is not None else None
        for j in range(len(d) + 1):
            rows.append(DraftRow(st.sampling, st.token_ids, st.num_generated + j,
                                 None if st.controls is None else with_tokens(st.controls, d[:j]), constraint, d[:j]))
    return rows


def with_tokens(controls: RowControls, tokens: list[int]) -> RowControls:
    """A copy of a sequence's controls that has also generated `tokens`."""
    copy = RowControls(controls.bias, controls.hold_back,
                       None if controls.counts is None else controls.counts.clone(),
                       None if controls.seen is None else controls.seen.clone())
    for t in tokens:
        copy.record(t)
    return copy


@dataclass
class DraftOutcome:
    token_ids: list[int]  # each sequence's last emitted token
    rows: list[int]  # the scored row that token came from (its logprobs, its top alternatives)
    accepted: list[list[int]]  # each sequence's kept drafts
    failures: list[tuple[int, str]] = field(default_factory=list)  # (sequence, error) of the drafted constrained samples that failed


def pack(result: worker_pb2.StepResult, outcome: DraftOutcome, logits: torch.Tensor, logprobs: torch.Tensor | None,
         num_top: int) -> None:
    """The kept drafts into `result`: how many per sequence, their ids, and where logprobs are asked, each one's
    logprob and top alternatives (from its own row: a kept draft is the token that row sampled)."""
    result.num_accepted_drafts.extend(len(kept) for kept in outcome.accepted)
    result.accepted_draft_ids.extend(t for kept in outcome.accepted for t in kept)
    kept_rows = [r for last, kept in zip(outcome.rows, outcome.accepted) for r in range(last - len(kept), last)]
    if not kept_rows:
        return
    if logprobs is not None:
        result.accepted_draft_logprobs.extend(logprobs[kept_rows].tolist())
    if num_top:
        ids, values = top_logprobs(logits[kept_rows], num_top)
        result.accepted_draft_top_token_ids.extend(ids.flatten().tolist())
        result.accepted_draft_top_logprobs.extend(values.flatten().tolist())


def sequence_of_row(starts: list[int], row: int) -> int:
    """Which sampling sequence a scored row belongs to (`logits_rows`' starts)."""
    return bisect_right(starts, row) - 1


def settle(states: list[DraftedState], drafts: list[list[int]], starts: list[int], row_tokens: list[int],
           block_size: int) -> DraftOutcome:
    """Each sequence's tokens from its rows' choices: appended to it, its computed count and block table brought
    to what it holds now (every token but the last computed; blocks past its tokens dropped)."""
    outcome = DraftOutcome([], [], [])
    for i, (st, d, start, stop) in enumerate(zip(states, drafts, starts, starts[1:])):
        verdict = verify_greedy(row_tokens[start:stop], d)  # no drafts: the row's own token
        if d and st.controls is not None:  # the batch recorded a drafted sequence's rows in their copies
            for t in verdict.tokens:
                st.controls.record(t)
        if d and st.constraint is not None:  # the batch left a drafted sequence's matcher as it was
            advance_drafted(st.constraint, verdict.tokens)
            if st.constraint.error:
                outcome.failures.append((i, st.constraint.error))
        st.token_ids.extend(verdict.tokens)
        st.num_generated += len(verdict.tokens)
        outcome.token_ids.append(verdict.tokens[-1])
        outcome.rows.append(start + verdict.accepted)
        outcome.accepted.append(verdict.tokens[:-1])
        if d:
            st.num_computed = len(st.token_ids) - 1
            st.block_table = st.block_table[:-(-len(st.token_ids) // block_size)]
    return outcome
