"""The paged KV block pool: reference counts and a free list. Knows block ids, never tensors."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(Exception):
    """Raised by `allocate` when fewer blocks are free than asked for (nothing is allocated)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # FIFO free list: a freed block goes to the back, so recently freed blocks are reused last.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, block_id: int) -> None:
        """Another block table holds this block (copy-on-write sharing)."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks no table holds go back to the free list.

        Released in reverse so a sequence's tail blocks are reused before its head.
        """
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
