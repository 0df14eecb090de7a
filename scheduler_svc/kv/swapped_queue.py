"""Sequences preempted to the worker's host memory (`preemption_mode = swap`), oldest first.

A swapped-out sequence keeps its tokens and its computed count; its device blocks are freed (the
worker copies their K/V to host memory first) and it waits here until blocks for it are free again.
It comes back, into fresh blocks, before anything new is admitted (`Scheduler.schedule`), to the
status it had (a prompt still computing, or a decode).
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus


class SwappedQueue:
    """The swapped-out sequences, oldest first, each with the status it returns to (the scheduler sets a
    sequence's status; this queue keeps the one it had)."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[tuple[Sequence, SequenceStatus]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, seq: Sequence) -> None:
        """`seq` was swapped out (`KVCacheManager.swap_out`); it comes back to the status it has now."""
        self._queue.append((seq, seq.status))

    def pop_ready(self, kv_cache: KVCacheManager) -> tuple[Sequence, list[int], SequenceStatus] | None:
        """The oldest sequence, swapped back into fresh blocks if they fit: (it, its new block table, the status
        it returns to). None: it waits, and the others behind it. Not while its token is in flight
        (overlap.py): once it is back."""
        seq, status = self._queue[0]
        if seq.awaiting_token or not kv_cache.can_swap_in(seq):
            return None
        self._queue.popleft()
        return seq, kv_cache.swap_in(seq), status

    def remove(self, seq: Sequence) -> None:
        for entry in self._queue:
            if entry[0] is seq:
                self._queue.remove(entry)
                return
        raise ValueError("not swapped out")

    def clear(self) -> None:
        self._queue.clear()
