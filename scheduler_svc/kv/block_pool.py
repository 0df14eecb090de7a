"""The paged KV block pool: reference counts, a free list and the prefix cache's hash table.

Knows block ids, never tensors. A block is *used* (ref count > 0), *free* or *cached-free*
(ref count 0 but still holding a prefix-cache entry that a later request can revive).

The free list is intrusive and doubly linked (arrays of prev/next indices, as in vLLM v1's
block_pool): reviving a cached free block unlinks it in O(1), whatever the pool size.
Allocation takes the head, release appends to the tail, so the least recently freed block
is reused (and its hash evicted) first; a sequence releases its blocks tail first, so its
tail is evicted before its head, which other prompts are likelier to share.
"""

from __future__ import annotations

from collections.abc import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partly filled)."""
    return -(-num_tokens // block_size)


class OutOfBlocksError(Exception):
    """Raised by `allocate` when fewer blocks are free than asked for (nothing is allocated)."""


class BlockPool:
    def __init__(self, num_blocks: int, cache_freed_blocks: bool = False) -> None:
        """`cache_freed_blocks`: the `lru` policy (freed blocks keep their hash until reused);
        False is `ref_zero` (a block's hash goes when its last user frees it)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache_freed_blocks = cache_freed_blocks
        self.ref_counts = [0] * num_blocks
        # Prefix cache: hash -> block, and per block its hash and the tokens it holds.
        self.cached: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.num_cached_free = 0
        # Intrusive doubly linked free list; index `num_blocks` is the sentinel.
        self._head = num_blocks
        self._next = list(range(1, num_blocks + 1)) + [0]
        self._prev = [num_blocks] + list(range(num_blocks))
        self._next[num_blocks], self._prev[num_blocks] = 0, num_blocks - 1
        self._is_free = [True] * num_blocks
        self.num_free = num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ------------------------------------------------------------------ free list

    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p], self._prev[n] = n, p
        self._is_free[b] = False
        self.num_free -= 1

    def _append(self, b: int) -> None:
        last = self._prev[self._head]
        self._next[last], self._prev[b] = b, last
        self._next[b], self._prev[self._head] = self._head, b
        self._is_free[b] = True
        self.num_free += 1

    def free_blocks(self) -> list[int]:
        """The free list in reuse order (for tests and invariant checks)."""
        out, b = [], self._next[self._head]
        while b != self._head:
            out.append(b)
            b = self._next[b]
        return out

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    # ------------------------------------------------------------------ allocation

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free} free")
        blocks = []
        head, nxt, prev, block_hash, ref_counts, is_free = (self._head, self._next, self._prev, self.block_hash,
                                                            self.ref_counts, self._is_free)
        for _ in range(count):  # _unlink of the head's next, inlined (once per block of every admission)
            b = nxt[head]
            if block_hash[b] is not None:
                self._evict(b)  # a reused block's old content is gone
            n = nxt[b]
            nxt[head], prev[n] = n, head
            is_free[b] = False
            ref_counts[b] = 1
            blocks.append(b)
        self.num_free -= count
        return blocks

    def share(self, block_id: int) -> None:
        """Another block table holds this block (copy-on-write sharing)."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks no table holds go back to the free list.

        Released in reverse so a sequence's tail blocks are reused before its head.
        """
        for b in reversed(list(block_ids)):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.cache_freed_blocks and self.block_hash[b] is not None:
                    self.num_cached_free += 1
                else:
                    self._evict(b)
                self._append(b)

    # ------------------------------------------------------------------ prefix cache

    def register(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Record that a used, full block holds `tokens` under `block_hash`.

        A hash already cached (the same prefix computed twice at once) keeps its first block;
        the duplicate stays uncached and is freed like any other block.
        """
        if block_hash in self.cached or self.block_hash[block_id] is not None:
            return False
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        return True

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached block for this hash, if it holds exactly `tokens` (guards collisions)."""
        b = self.cached.get(block_hash)
        if b is None or self.block_tokens[b] != tokens:
            return None
        return b

    def touch(self, block_id: int) -> None:
        """Take a reference to a cached block, reviving it from the free list if needed: O(1)."""
        if self.ref_counts[block_id] == 0:
            self._unlink(block_id)
            self.num_cached_free -= 1
        self.ref_counts[block_id] += 1

    def clear_cache(self) -> None:
        """Forget every cached hash (the KV tensor was dropped, e.g. a suspend in recompute mode)."""
        for b in list(self.cached.values()):
            self._evict(b)

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        if self.ref_counts[b] == 0 and self._is_free[b]:
            self.num_cached_free -= 1
        del self.cached[h]
        self.block_hash[b] = None
        self.block_tokens[b] = None
