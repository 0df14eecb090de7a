"""Embedding sequences on the worker (NewSequence.pooling): their rows' final-norm hidden states pooled into one
vector each, on the device, across as many prompt chunks as the scheduler splits them into.

The LM head never runs for these rows. `mean` keeps a float32 running sum per sequence between chunks; `cls`
keeps the first position's row; `last` reads the prompt's last row. The vector goes back (StepResult.embeddings)
in the step that computes the prompt's last token, not normalised: the gateway applies `dimensions` and the L2
norm (hetero_common/embedding_vectors.py), so the worker's answer is the same whatever the request asked.
A sequence recomputed after a preemption is a new sequence here, so its sum starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hetero.v1 import common_pb2, worker_pb2

LAST, MEAN, CLS = common_pb2.POOLING_LAST, common_pb2.POOLING_MEAN, common_pb2.POOLING_CLS


class PooledSequence(Protocol):
    """What pooling reads and keeps of a sequence's worker state (step_io.SequenceState)."""

    pooling: int
    pooled: torch.Tensor | None  # float32 [hidden]: mean's running sum, or cls's row, between chunks
    token_ids: list[int]


@dataclass
class PoolingEntry:
    """One embedding sequence's share of a step."""

    seq_id: int
    state: PooledSequence
    first_row: int  # its first row in the step's flattened tokens
    first_position: int  # the prompt position of that row
    num_rows: int
    completes: bool  # the step computes the prompt's last token: the vector goes back

    def rows(self) -> range:
        """The rows its pooling reads this step."""
        if self.state.pooling == MEAN:
            return range(self.first_row, self.first_row + self.num_rows)
        if self.state.pooling == CLS:
            return range(self.first_row, self.first_row + 1) if self.first_position == 0 else range(0)
        return range(self.first_row + self.num_rows - 1, self.first_row + self.num_rows) if self.completes else range(0)


class NormModel(Protocol):
    def final_normed(self, hidden: torch.Tensor) -> torch.Tensor: ...


def pool(model: NormModel, hidden: torch.Tensor, entries: list[PoolingEntry]) -> list[worker_pb2.PooledEmbedding]:
    """Pool the step's rows into their sequences (one final norm over all the rows read); return the vectors of
    the sequences the step completes, in entry order."""
    row_lists = [entry.rows() for entry in entries]
    index = torch.tensor([r for rows in row_lists for r in rows], dtype=torch.int64, device=hidden.device)
    normed = model.final_normed(hidden[index]).float() if index.numel() else hidden.new_zeros((0, hidden.shape[1]))
    done: list[worker_pb2.PooledEmbedding] = []
    at = 0
    for entry, rows in zip(entries, row_lists):
        part, at = normed[at:at + len(rows)], at + len(rows)
        state = entry.state
        if state.pooling == MEAN:
            total = part.sum(0)
            state.pooled = total if state.pooled is None else state.pooled + total
        elif len(rows):
            state.pooled = part[0].clone()
        if entry.completes:
            vector = state.pooled
            if vector is None:
                raise ValueError(f"sequence {entry.seq_id}: no pooled rows at its last prompt token")
            if state.pooling == MEAN:
                vector = vector / len(state.token_ids)
            done.append(worker_pb2.PooledEmbedding(seq_id=entry.seq_id, values=vector.cpu().tolist()))
            state.pooled = None
    return done
