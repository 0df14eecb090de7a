"""Sequences preempted to the worker's host memory (`preemption_mode = swap`), oldest first.

A swapped-out sequence keeps its tokens and its computed count; its device blocks are freed (the
worker copies their K/V to host memory first) and it waits here until blocks for it are free again.
It comes back, into fresh blocks, before anything new is admitted (`Scheduler.schedule`), to the
status it had (a prompt still computing, or a decode).
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.core.sequence import Sequence, SequenceStatus
from scheduler_svc.kv.kv_cache_manager import KVCacheManager


class SwappedQueue:
    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, seq: Sequence, num_held_blocks: int) -> None:
        """`seq` was swapped out: the worker holds its first `num_held_blocks` blocks in host memory."""
        seq.pending_edits = []
        seq.num_swapped_blocks, seq.num_blocks_sent = num_held_blocks, 0
        seq.swapped_status, seq.status = seq.status, SequenceStatus.SWAPPED
        self._queue.append(seq)

    def pop_ready(self, kv_cache: KVCacheManager) -> Sequence | None:
        """The oldest sequence, swapped back into fresh blocks, if they fit (None: it waits, and the others
        behind it). Not while its token is in flight (overlap.py): once it is back."""
        seq = self._queue[0]
        if seq.awaiting_token or not kv_cache.can_swap_in(seq):
            return None
        self._queue.popleft()
        seq.num_blocks_sent = len(kv_cache.swap_in(seq))
        seq.status, seq.swapped_status = seq.swapped_status or SequenceStatus.DECODE, None
        return seq

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def clear(self) -> None:
        self._queue.clear()
