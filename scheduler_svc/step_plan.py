"""Writing a step's decisions into its StepPlan as diffs against what the worker already holds:
a sequence is sent whole once, afterwards only its appended blocks and table edits."""

from __future__ import annotations

from hetero.v1 import worker_pb2
from scheduler_svc.kv_cache_manager import CopiedBlock
from scheduler_svc.sequence import Sequence


def plan_needs_worker(plan: worker_pb2.StepPlan) -> bool:
    """Whether a plan must reach the worker: tokens to compute, or blocks to swap or copy.

    A swap-in alone must be sent even when nothing is computed this step: the sequence's
    block table and K/V arrive with it."""
    return bool(plan.scheduled or plan.swap_out or plan.swap_in or plan.block_copies)


def add_scheduled(plan: worker_pb2.StepPlan, seq: Sequence, num_tokens: int) -> None:
    """Schedule `num_tokens` of the sequence's uncomputed tokens; its blocks are already allocated."""
    if not seq.on_worker:
        plan.new_sequences.append(worker_pb2.NewSequence(
            seq_id=seq.seq_id, token_ids=seq.token_ids, params=seq.params, num_generated=seq.num_generated))
        seq.on_worker = True
    entry = worker_pb2.ScheduledSequence(
        seq_id=seq.seq_id, num_tokens=num_tokens, new_block_ids=seq.block_table[seq.num_blocks_sent:],
        sample=seq.num_computed + num_tokens == seq.num_tokens, num_cached_tokens=seq.num_computed)
    for index, block_id in seq.pending_edits:
        entry.block_table_edits.add(index=index, block_id=block_id)
    seq.pending_edits.clear()
    plan.scheduled.append(entry)
    seq.num_blocks_sent = len(seq.block_table)


def add_block_copies(block_copies: list[worker_pb2.BlockCopy], seq: Sequence, copies: list[CopiedBlock]) -> None:
    """The worker copies each shared block before the step writes into it; where the worker
    already holds the old block id in the sequence's table, the table is edited too."""
    for c in copies:
        block_copies.append(worker_pb2.BlockCopy(src=c.src, dst=c.dst))
        if c.index < seq.num_blocks_sent:
            seq.pending_edits.append((c.index, c.dst))
