"""The scheduler's waiting queue, in priority order.

Requests are served in (priority, position) order: a lower priority value first (vLLM's
convention), and within one priority class first come, first served. `append` puts a sequence
at the back of its class, `appendleft` at the front (a preempted sequence goes back ahead of
the others of its class, as it had been admitted before them). When every priority is 0 the
order is exactly a deque's, so plain FIFO behaviour is unchanged.

A binary heap of [priority, position, sequence] entries: push and pop are O(log n). Removal
(an abort of a waiting request) blanks the entry in O(1); blank entries are dropped when they
reach the top.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Iterator

from scheduler_svc.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[list] = []  # [priority, position, Sequence | None]
        self._entries: dict[Sequence, list] = {}  # live entries by sequence (identity: Sequence has eq=False)
        self._back = 0  # next position at the back; appendleft takes positions below the front
        self._front = 0
        # Sticky: once a request with priority != 0 came, preemption victims are chosen by priority
        # (`scheduler.preemption_victim`); until then the plain newest-first choice, as cheap as before priorities.
        self.any_priority = False

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._entries

    def __iter__(self) -> Iterator[Sequence]:
        """Live sequences in service order (a sorted copy: for stats and recovery, not the hot path)."""
        return iter([e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1]))])

    def append(self, seq: Sequence) -> None:
        self._push(seq, self._back)
        self._back += 1

    def appendleft(self, seq: Sequence) -> None:
        self._front -= 1
        self._push(seq, self._front)

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def _push(self, seq: Sequence, position: int) -> None:
        if seq.info.priority:
            self.any_priority = True
        entry = [seq.info.priority, position, seq]
        self._entries[seq] = entry
        heapq.heappush(self._heap, entry)

    def peek(self) -> Sequence:
        """The next sequence to admit (IndexError when empty)."""
        heap = self._heap
        while heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0][2]

    def popleft(self) -> Sequence:
        heap = self._heap
        while True:
            seq = heapq.heappop(heap)[2]
            if seq is not None:
                del self._entries[seq]
                return seq

    def remove(self, seq: Sequence) -> None:
        self._entries.pop(seq)[2] = None

    def clear(self) -> None:
        self._heap.clear()
        self._entries.clear()

