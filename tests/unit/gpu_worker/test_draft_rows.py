"""The worker's side of speculative decoding (gpu_worker/sampling/draft_rows.py): which rows a drafted decode scores,
which output index each row samples, what a sequence keeps, and the plan's drafts checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from gpu_worker.sampling import draft_rows
from gpu_worker.sampling.logits_processors import RowControls
from hetero.v1 import common_pb2, worker_pb2
from hetero_common.errors import ExecutionError
from hetero_common.sampling import Sampling, resolve

GREEDY = resolve(common_pb2.SamplingParams(temperature=0.0))


@dataclass
class State:
    token_ids: list[int]
    sampling: Sampling = GREEDY
    num_generated: int = 0
    num_computed: int = 0
    block_table: np.ndarray = field(default_factory=lambda: np.arange(8, dtype=np.int32))
    controls: RowControls | None = None
    constraint: None = None


def test_a_drafted_sequence_scores_its_last_k_plus_one_rows() -> None:
    qo_indptr = torch.tensor([0, 5, 6, 10])  # a prompt chunk of 5 (no sample), a decode, a decode with 3 drafts
    rows, starts = draft_rows.logits_rows(qo_indptr, [1, 2], [[], [7, 8, 9]])
    assert rows.tolist() == [5, 6, 7, 8, 9] and starts == [0, 1, 5]
    assert [draft_rows.sequence_of_row(starts, r) for r in range(5)] == [0, 1, 1, 1, 1]


def test_each_row_of_a_drafted_sequence_samples_its_own_output_index_with_its_own_history() -> None:
    penalised = resolve(common_pb2.SamplingParams(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.2,
                                                  min_tokens=6))
    plain, drafted = State([1, 2], num_generated=4), State([1, 2, 3], sampling=penalised, num_generated=4)
    rows = draft_rows.expand([plain, drafted], [[], [7, 7, 9]], 16, [0], torch.device("cpu"))
    assert rows[0] is plain and [r.num_generated for r in rows[1:]] == [4, 5, 6, 7]
    assert drafted.controls is not None and drafted.controls.counts is not None
    assert [float(r.controls.counts[7]) for r in rows[1:]] == [0.0, 1.0, 2.0, 2.0]  # d_1..d_j counted in row j
    assert [bool(r.controls.seen[9]) for r in rows[1:]] == [False, False, False, True]
    assert float(drafted.controls.counts[7]) == 0.0  # the sequence's own: what it keeps, after the step
    draft_rows.settle([plain, drafted], [[], [7, 7, 9]], [0, 1, 5], [5, 7, 7, 4, 0], block_size=4)
    assert float(drafted.controls.counts[7]) == 2.0 and float(drafted.controls.counts[4]) == 1.0
    assert not bool(drafted.controls.seen[9])


def test_a_sequence_keeps_the_matching_drafts_then_its_own_token_and_drops_blocks_past_its_tokens() -> None:
    plain, drafted = State([1, 2, 3]), State([1, 2, 3, 4, 5, 6, 7], num_generated=2, num_computed=10)
    # rows: plain's 1 row; drafted's 4 rows for drafts [8, 9, 5]: the model chose 8, 9, then 6 (not 5), then 0
    outcome = draft_rows.settle([plain, drafted], [[], [8, 9, 5]], [0, 1, 5], [42, 8, 9, 6, 0], block_size=4)
    assert outcome.token_ids == [42, 6] and outcome.rows == [0, 3] and outcome.accepted == [[], [8, 9]]
    assert plain.token_ids == [1, 2, 3, 42] and plain.num_generated == 1
    assert drafted.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 6] and drafted.num_generated == 5
    assert drafted.num_computed == 9  # every token but the last
    assert len(drafted.block_table) == 3  # 10 tokens in blocks of 4
    assert len(plain.block_table) == 8  # no drafts: its table is the plan's


def test_kept_drafts_logprobs_come_from_their_own_rows() -> None:
    outcome = draft_rows.DraftOutcome(token_ids=[6], rows=[2], accepted=[[8, 9]])
    logits = torch.log_softmax(torch.randn(4, 10), dim=-1)
    logprobs = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    result = worker_pb2.StepResult()
    draft_rows.pack(result, outcome, logits, logprobs, num_top=2)
    assert list(result.num_accepted_drafts) == [2] and list(result.accepted_draft_ids) == [8, 9]
    assert [round(x, 4) for x in result.accepted_draft_logprobs] == [-0.1, -0.2]
    assert list(result.accepted_draft_top_token_ids) == logits[:2].topk(2).indices.flatten().tolist()


def test_drafts_the_scheduler_would_not_send_are_refused() -> None:
    draft_rows.check_drafts(3, True, [5, 6], end=12, known=10)
    with pytest.raises(ExecutionError, match="not sampled"):
        draft_rows.check_drafts(3, False, [5], 11, 10)
    with pytest.raises(ExecutionError, match="drafts follow the last token"):
        draft_rows.check_drafts(3, True, [5, 6], end=11, known=10)
