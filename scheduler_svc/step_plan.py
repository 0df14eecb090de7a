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


def add_scheduled(plan: worker_pb2.StepPlan, scheduled: list[tuple[Sequence, int]]) -> None:
    """Schedule each sequence's next `num_tokens` uncomputed tokens; their blocks are already allocated.

    Entries are built in place with `add` (constructing a message and appending it copies it), and
    the optional fields are set only when they have something to say; proto3 leaves empty fields out
    of the wire format either way, so the bytes are those of a fully spelled-out entry."""
    add_entry, add_new = plan.scheduled.add, plan.new_sequences.add
    for seq, num_tokens in scheduled:
        if not seq.on_worker:
            add_new(seq_id=seq.seq_id, token_ids=seq.token_ids, params=seq.params,
                    num_generated=len(seq.token_ids) - seq.prompt_len)
            seq.on_worker = True
        num_computed, table, sent = seq.num_computed, seq.block_table, seq.num_blocks_sent
        entry = add_entry(seq_id=seq.seq_id, num_tokens=num_tokens, sample=num_computed + num_tokens == len(seq.token_ids),
                          num_cached_tokens=num_computed)
        if len(table) > sent:
            entry.new_block_ids.extend(table[sent:])
        seq.num_blocks_sent = len(table)
        if seq.pending_edits:
            for index, block_id in seq.pending_edits:
                entry.block_table_edits.add(index=index, block_id=block_id)
            seq.pending_edits.clear()


def add_block_copies(block_copies: list[worker_pb2.BlockCopy], seq: Sequence, copies: list[CopiedBlock]) -> None:
    """The worker copies each shared block before the step writes into it; where the worker
    already holds the old block id in the sequence's table, the table is edited too."""
    for c in copies:
        block_copies.append(worker_pb2.BlockCopy(src=c.src, dst=c.dst))
        if c.index < seq.num_blocks_sent:
            seq.pending_edits.append((c.index, c.dst))
