"""Block bookkeeping for the scheduler: which KV blocks each sequence holds, and why.

The scheduler decides who runs; this manager answers whether blocks are there for it and
hands them out: prefix-cache matches at admission, blocks for the next tokens (with private
copies of shared blocks about to be written: copy-on-write), registering full blocks in the
prefix cache, sharing a prompt's blocks with forked samples, swap-out and swap-in, freeing.
It alone talks to the `BlockPool`, so reference counts never leak into scheduling policy.
It edits a sequence's `block_table`, `block_hashes`, `num_registered` and, at admission,
`num_computed` and `cached_prompt_tokens`; what the worker has been sent (`num_blocks_sent`,
table edits) stays the scheduler's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_svc.core.sequence import Sequence, fork_sample
from scheduler_svc.kv.block_pool import BlockPool, OutOfBlocksError, blocks_for
from scheduler_svc.kv.prefix_cache import extend_hashes


@dataclass(frozen=True)
class CopiedBlock:
    """A shared block replaced by a private copy in one sequence's table (copy-on-write)."""

    index: int  # position in the sequence's block table
    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 cache_freed_blocks: bool) -> None:
        """`cache_freed_blocks`: the `lru` eviction policy (see `BlockPool`)."""
        self.pool = BlockPool(num_blocks, cache_freed_blocks=cache_freed_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    # ---------------------------------------------------------------- capacity

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def num_cached_free(self) -> int:
        return self.pool.num_cached_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed: int | None = None,
                       num_blocks: int | None = None) -> int:
        """Blocks to add to the table so that `num_new_tokens` more tokens fit."""
        total = (seq.num_computed if num_computed is None else num_computed) + num_new_tokens
        held = len(seq.block_table) if num_blocks is None else num_blocks
        return max(0, blocks_for(total, self.block_size) - held)

    # ---------------------------------------------------------------- admission

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest run of this sequence's leading full blocks.

        At most (tokens - 1) // block_size blocks: the last token is always computed (its
        logits are needed), and its block is never a shared cached one. None for a request
        that asks for prompt logprobs (scheduler_svc/core/prompt_logprobs.py) or an embedding.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.computes_whole_prompt:
            return []  # cached positions have no logits or pooled rows: these need all of them computed
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs
        if len(seq.block_hashes) < usable:
            extend_hashes(seq.block_hashes, seq.packed(usable * bs), bs, usable, seq.cache_salt)
        hits = []
        cached, hashes, token_ids = self.pool.cached, seq.block_hashes, seq.token_ids
        for i in range(usable):  # the ids are compared only for a hash in the cache (most prompts miss at once)
            b = self.pool.lookup(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])) if hashes[i] in cached else None
            if b is None:
                break
            hits.append(b)
        return hits

    def num_blocks_to_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> int:
        """Free-list blocks that admitting `seq` with these hits and its first tokens would take."""
        ref_counts = self.pool.ref_counts
        revived = sum(1 for b in hits if ref_counts[b] == 0) if hits else 0  # cached-free blocks leave the free list
        return revived + self._blocks_needed(seq, num_new_tokens, len(hits) * self.block_size, len(hits))

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int, max_used_blocks: float) -> bool:
        """Whether admitting `seq` with these hits and its first tokens finds the blocks free, and leaves at
        most `max_used_blocks` in use (the scheduler's memory threshold)."""
        needed = self.num_blocks_to_admit(seq, hits, num_new_tokens)
        return self.can_allocate(needed) and self.pool.num_used + needed <= max_used_blocks

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """The hits become the head of the sequence's table, already computed, and blocks for its first
        `num_new_tokens` tokens follow them (`can_admit` found them)."""
        for b in hits:
            self.pool.touch(b)
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        if seq.cached_prompt_tokens is None:  # count a prompt once, not again after a preemption
            seq.cached_prompt_tokens = min(seq.num_computed, seq.prompt_len)
            if self.enable_prefix_caching and not seq.computes_whole_prompt:  # only prompts looked up count
                self.prefix_cache_queries += seq.prompt_len
                self.prefix_cache_hits += seq.cached_prompt_tokens
        copies = self.allocate_slots(seq, num_new_tokens)  # past the cached blocks: none shared
        assert not copies, "admission: blocks short or shared"

    # ---------------------------------------------------------------- growing a table

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[CopiedBlock] | None:
        """Blocks for the next `num_new_tokens` tokens, and private copies of the shared blocks
        they write into; the copies are returned for the worker to make.

        None when the pool runs short. Blocks appended before the copy-on-write found it short
        stay in the table, so a retry after freeing others takes only what is still missing.
        """
        table, bs = seq.block_table, self.block_size
        end = seq.num_computed + num_new_tokens
        if num_new_tokens == 1 and end <= len(table) * bs and self.pool.ref_counts[table[(end - 1) // bs]] == 1:
            return []  # a decode writing into a block of its own: nothing to allocate or copy
        fresh = seq.num_computed // bs >= len(table)  # every block written is allocated now (admission): none shared
        try:
            table.extend(self.pool.allocate(self._blocks_needed(seq, num_new_tokens)))
            return [] if fresh else self._copy_on_write(seq, num_new_tokens)
        except OutOfBlocksError:
            return None

    def _copy_on_write(self, seq: Sequence, num_new_tokens: int) -> list[CopiedBlock]:
        bs = self.block_size
        first, last = seq.num_computed // bs, (seq.num_computed + num_new_tokens - 1) // bs
        shared = [i for i in range(first, last + 1) if self.pool.ref_counts[seq.block_table[i]] > 1]
        if len(shared) > self.pool.num_free:
            raise OutOfBlocksError(f"copy-on-write needs {len(shared)} blocks, {self.pool.num_free} free")
        copies = []
        for i in shared:
            src, (dst,) = seq.block_table[i], self.pool.allocate(1)
            self.pool.release([src])
            seq.block_table[i] = dst
            copies.append(CopiedBlock(i, src, dst))
        return copies

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list holds the blocks for `num_new_tokens` more tokens (copy-on-write aside)."""
        return self._blocks_needed(seq, num_new_tokens) <= self.pool.num_free

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens' (speculative drafts the worker rejected, which
        the worker drops from its table by the same rule). Never registered: they hold no computed token."""
        keep = blocks_for(num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]
            seq.num_blocks_sent = min(seq.num_blocks_sent, keep)
            seq.fast_until = 0

    def decode_room(self, seq: Sequence, num_computed: int) -> int:
        """The token count up to which the sequence's decodes from position `num_computed` on write into
        blocks it already holds alone (no allocation, no copy-on-write: `allocate_slots` returns []) and,
        with prefix caching, fill no block still to register (`register_full_blocks` has nothing to do
        after them); 0 if none."""
        bs = self.block_size
        table, first = seq.block_table, num_computed // bs
        if first >= len(table):
            return 0
        ref_counts = self.pool.ref_counts
        for b in table[first:]:  # one or two blocks, mostly: a loop, not a generator
            if ref_counts[b] != 1:
                return 0
        if self.enable_prefix_caching:  # the blocks registered once the step computing up to `num_computed` is applied
            registered = max(seq.num_registered, num_computed // bs)
            return min(len(table) * bs, (registered + 1) * bs - 1)
        return len(table) * bs

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed < (seq.num_registered + 1) * bs:
            return  # no block filled since the last call (most steps of a decode)
        full = min(seq.num_computed // bs, len(seq.block_table))
        if full <= seq.num_registered:
            return
        if len(seq.block_hashes) < full:
            extend_hashes(seq.block_hashes, seq.packed(full * bs), bs, full, seq.cache_salt)
        for i in range(seq.num_registered, full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        seq.num_registered = full

    def fork(self, parent: Sequence, index: int, seq_id: int) -> Sequence:
        """Sample `index` of the parent's request, holding the parent's prompt blocks by reference."""
        child = fork_sample(parent, index, seq_id, self.block_size)
        parent.fast_until = 0  # its blocks are shared now: its next write may need a copy
        for b in child.block_table:
            self.pool.share(b)
        return child

    # ---------------------------------------------------------------- giving blocks back

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its table is empty afterwards."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.fast_until = 0
        seq.num_registered = 0

    def swap_out(self, seq: Sequence) -> list[int]:
        """Free the sequence's blocks; return those holding K/V, for the worker to copy to host first."""
        held = seq.block_table[:blocks_for(seq.num_computed, self.block_size)]
        self.free(seq)
        return held

    def can_swap_in(self, seq: Sequence) -> bool:
        """Room for the swapped blocks and for the block the next token goes into."""
        next_token_blocks = blocks_for(seq.num_computed + 1, self.block_size)
        return self.can_allocate(max(seq.num_swapped_blocks, next_token_blocks))

    def swap_in(self, seq: Sequence) -> list[int]:
        """Fresh blocks for the swapped K/V: the sequence's new table (not in the prefix cache)."""
        seq.block_table = self.pool.allocate(seq.num_swapped_blocks)
        seq.num_registered = 0
        return seq.block_table

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash: the blocks' K/V is gone or not to be trusted."""
        self.pool.clear_cache()

    # ---------------------------------------------------------------- figures

    def internal_waste(self, seqs: Iterable[Sequence]) -> float:
        """Allocated token slots not holding a token / allocated slots (a shared block counted
        once, with the most tokens any of its holders keeps in it)."""
        bs = self.block_size
        fill: dict[int, int] = {}
        for seq in seqs:
            for i, b in enumerate(seq.block_table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_tokens - i * bs)))
        allocated_slots = len(fill) * bs
        held_tokens = sum(fill.values())
        return (allocated_slots - held_tokens) / allocated_slots if allocated_slots else 0.0
