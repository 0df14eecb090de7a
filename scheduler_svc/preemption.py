"""Preemption: whom to preempt when blocks run out, and the two ways of doing it.

`recompute` frees the sequence's blocks and re-queues it at the front of its priority class
with every token so far (prompt plus output), to be computed again; `swap` has the worker
copy its blocks to host memory and brings them back before anything new is admitted. Either
way its stream neither loses nor repeats a token. These functions act on the scheduler's own
queues; `Scheduler._preempt` picks the mode and counts.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import structlog

from hetero.v1 import worker_pb2
from hetero_common.config import Config
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.waiting_queue import WaitingQueue

log = structlog.get_logger("scheduler_svc.scheduler")


class Scheduler(Protocol):
    """What preemption touches of the Scheduler (scheduler.py; not imported: it imports this module)."""

    running: list[Sequence]
    waiting: WaitingQueue
    swapped: deque[Sequence]
    kv_cache: KVCacheManager
    _swap_out: list[worker_pb2.SwapBlocks]
    _block_copies: list[worker_pb2.BlockCopy]
    num_swap_outs: int
    config: Config

    def _release_on_worker(self, seq: Sequence) -> None: ...


def preemption_victim(running: list[Sequence], seq: Sequence, step_id: int, any_priority: bool) -> Sequence:
    """Whom to preempt so that `seq` can grow: the lowest-priority running sequence (highest value)
    not in this step's batch, among equals the newest; `seq` itself when none can give way, or
    when its own priority is strictly lower than every candidate's. `any_priority` False (every
    priority 0 so far) takes the plain newest-first path, which is all FIFO needs."""
    if not any_priority:
        return next((s for s in reversed(running) if s is not seq and s.last_scheduled_step != step_id), seq)
    victim = None
    for s in reversed(running):  # newest first; only a strictly larger value replaces, so ties keep the newest
        if s is not seq and s.last_scheduled_step != step_id and (victim is None or s.priority > victim.priority):
            victim = s
    return seq if victim is None or seq.priority > victim.priority else victim


def preempt_recompute(s: Scheduler, seq: Sequence) -> None:
    """Free the blocks, re-queue at the front of its priority class with all tokens so far."""
    s.running.remove(seq)
    s.kv_cache.free(seq)
    s._release_on_worker(seq)
    seq.reset_for_recompute()
    s.waiting.appendleft(seq)
    log.info("preempted", mode="recompute", request_id=seq.request_id, tokens=seq.num_tokens, free_blocks=s.kv_cache.num_free)


def preempt_swap(s: Scheduler, seq: Sequence) -> None:
    """The worker copies the blocks holding K/V to host memory; the device blocks are freed."""
    s.running.remove(seq)
    held = s.kv_cache.swap_out(seq)
    s._swap_out.append(worker_pb2.SwapBlocks(seq_id=seq.seq_id, block_ids=held))
    seq.pending_edits = []
    seq.num_swapped_blocks, seq.num_blocks_sent = len(held), 0
    seq.swapped_status, seq.status = seq.status, SequenceStatus.SWAPPED
    s.swapped.append(seq)
    s.num_swap_outs += 1
    log.info("preempted", mode="swap", request_id=seq.request_id, blocks=len(held), free_blocks=s.kv_cache.num_free)


def swap_in_ready(s: Scheduler, plan: worker_pb2.StepPlan) -> None:
    """Bring swapped-out sequences back, oldest first, while their blocks fit (a step's third stage, before
    anything new is admitted). Not while a block copy is pending: a swap-in lands before the copies on the
    worker and could overwrite a source."""
    while s.swapped and not s._block_copies and len(s.running) < s.config.max_num_seqs:
        seq = s.swapped[0]
        if seq.awaiting_token or not s.kv_cache.can_swap_in(seq):  # its token in flight: once it is back
            break
        s.swapped.popleft()
        block_ids = s.kv_cache.swap_in(seq)
        seq.num_blocks_sent = len(block_ids)
        plan.swap_in.append(worker_pb2.SwapBlocks(seq_id=seq.seq_id, block_ids=block_ids))
        seq.status, seq.swapped_status = seq.swapped_status or SequenceStatus.DECODE, None
        s.running.append(seq)
