"""Block bookkeeping for the scheduler: which KV blocks each sequence holds, and why.

The scheduler decides who runs; this manager answers whether blocks are there for it and hands them out:
prefix-cache matches at admission, blocks for the next tokens (with private copies of shared blocks about
to be written: copy-on-write), registering full blocks in the prefix cache, sharing a prompt's blocks with
forked samples, swap-out and swap-in, freeing. It alone talks to the `BlockPool`, so reference counts never
leak into scheduling policy, and it alone holds block tables: one `SequenceBlocks` per seq id. What the worker
is to be told of a table comes out as a value, `KVBlocks` (`take_unsent`), which the plan writer sends;
nothing outside `kv/` reads or writes a table. It reads a `Sequence` (its id, tokens and computed count)
and writes none of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from scheduler_svc.kv.block_pool import BlockPool, OutOfBlocksError, blocks_for
from scheduler_svc.kv.prefix_cache import extend_hashes
from scheduler_svc.sequence import Sequence


@dataclass(frozen=True)
class CopiedBlock:
    """A shared block replaced by a private copy in one sequence's table (copy-on-write)."""

    index: int  # position in the sequence's block table
    src: int
    dst: int


class KVBlocks(NamedTuple):
    """What a sequence's block table gained since the worker was last told: blocks appended at its end, and
    blocks replaced in place (copy-on-write of a block the worker already has), as (index, block id).
    (A tuple: one is made per prompt chunk and per block a decode fills, and a tuple is the cheapest record.)"""

    new_block_ids: list[int]
    edits: list[tuple[int, int]]


NOTHING_NEW = KVBlocks([], [])  # most entries: a decode in blocks the worker has (`take_unsent` returns this one)


class SequenceBlocks:
    """One sequence's blocks: its table, how much of it the worker has, its prefix-cache hashes. (A plain
    class with slots: one is made per admitted sequence, and a dataclass's generated __init__ cost more.)"""

    __slots__ = ("table", "sent", "edits", "hashes", "registered", "host_blocks")

    def __init__(self, table: list[int] | None = None, hashes: list[bytes] | None = None, registered: int = 0) -> None:
        self.table: list[int] = table if table is not None else []
        self.sent = 0  # leading blocks of `table` the worker already has
        self.edits: list[tuple[int, int]] = []  # copy-on-write edits the worker is still to get
        self.hashes: list[bytes] = hashes if hashes is not None else []  # prefix-cache hashes of its full blocks
        self.registered = registered  # leading blocks of `table` offered to the prefix cache
        self.host_blocks = 0  # blocks the worker holds in host memory for it (swap-out)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 cache_freed_blocks: bool) -> None:
        """`cache_freed_blocks`: the `lru` eviction policy (see `BlockPool`)."""
        self.pool = BlockPool(num_blocks, cache_freed_blocks=cache_freed_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache
        # seq id -> its blocks, from `add` (or `fork`) to its end (`forget`); every other method expects it there
        self._blocks: dict[int, SequenceBlocks] = {}

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

    def _blocks_needed(self, num_computed: int, num_new_tokens: int, num_blocks: int) -> int:
        """Blocks to add to a table of `num_blocks` so that `num_new_tokens` more tokens fit."""
        return max(0, blocks_for(num_computed + num_new_tokens, self.block_size) - num_blocks)

    def table(self, seq: Sequence) -> tuple[int, ...]:
        """A copy of the sequence's block table, for figures and checks (the plan gets `take_unsent`'s values)."""
        blocks = self._blocks.get(seq.seq_id)
        return tuple(blocks.table) if blocks is not None else ()

    @property
    def num_tracked(self) -> int:
        """How many sequences have a record here (every unfinished one of the scheduler: no more, no fewer)."""
        return len(self._blocks)

    def num_held(self, seq: Sequence) -> int:
        """How many blocks the sequence's table holds."""
        blocks = self._blocks.get(seq.seq_id)
        return len(blocks.table) if blocks is not None else 0

    # ---------------------------------------------------------------- admission

    def add(self, seq: Sequence, hashes: list[bytes] | None = None) -> None:
        """A sequence joins (a new request or an adopted one), with its prompt's prefix-cache hashes when they were
        computed already (by the router): `match_prefix` reuses them. Its record is made now, with the request,
        not in the step that admits it."""
        self._blocks[seq.seq_id] = SequenceBlocks(None, list(hashes) if hashes else None)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest run of this sequence's leading full blocks.

        At most (tokens - 1) // block_size blocks: the last token is always computed (its
        logits are needed), and its block is never a shared cached one. None for a request
        that asks for prompt logprobs (core/prompt_logprobs.py) or an embedding.
        """
        if not self.enable_prefix_caching or seq.computes_whole_prompt:
            return []  # cached positions have no logits or pooled rows: these need all of them computed
        blocks = self._blocks[seq.seq_id]
        if blocks.table:
            return []
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs
        hashes = blocks.hashes
        if len(hashes) < usable:
            extend_hashes(hashes, seq.packed(usable * bs), bs, usable, seq.info.cache_salt)
        hits = []
        cached, token_ids = self.pool.cached, seq.token_ids
        for i in range(usable):  # the ids are compared only for a hash in the cache (most prompts miss at once)
            b = self.pool.lookup(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])) if hashes[i] in cached else None
            if b is None:
                break
            hits.append(b)
        return hits

    def num_blocks_to_admit(self, hits: list[int], num_new_tokens: int) -> int:
        """Free-list blocks that admitting a sequence with these hits and its first tokens would take."""
        ref_counts = self.pool.ref_counts
        revived = sum(1 for b in hits if ref_counts[b] == 0) if hits else 0  # cached-free blocks leave the free list
        return revived + self._blocks_needed(len(hits) * self.block_size, num_new_tokens, len(hits))

    def can_admit(self, hits: list[int], num_new_tokens: int, max_used_blocks: float) -> bool:
        """Whether admitting a sequence with these hits and its first tokens finds the blocks free, and leaves at
        most `max_used_blocks` in use (the scheduler's memory threshold)."""
        needed = self.num_blocks_to_admit(hits, num_new_tokens)
        return self.can_allocate(needed) and self.pool.num_used + needed <= max_used_blocks

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int, first: bool) -> int:
        """The hits become the head of the sequence's table, already computed, and blocks for its first
        `num_new_tokens` tokens follow them (`can_admit` found them). Returns the tokens the hits hold (the
        sequence's computed count). `first`: its first admission, counted in the prefix cache's figures
        (a prompt is counted once, not again after a preemption)."""
        for b in hits:
            self.pool.touch(b)
        blocks = self._blocks[seq.seq_id]
        blocks.table = list(hits)
        blocks.registered = len(hits)
        computed = len(hits) * self.block_size
        if first and self.enable_prefix_caching and not seq.computes_whole_prompt:  # only prompts looked up count
            prompt_len = seq.info.prompt_len
            self.prefix_cache_queries += prompt_len
            self.prefix_cache_hits += min(computed, prompt_len)
        copies = self.allocate_slots(seq, num_new_tokens, computed)  # past the cached blocks: none shared
        assert not copies, "admission: blocks short or shared"
        return computed

    # ---------------------------------------------------------------- growing a table

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       num_computed: int | None = None) -> list[CopiedBlock] | None:
        """Blocks for the next `num_new_tokens` tokens (after `num_computed`, else its own count), and private
        copies of the shared blocks they write into; the copies are returned for the worker to make (where the
        worker has the old block in its table, the edit waits in `take_unsent` too).

        None when the pool runs short. Blocks appended before the copy-on-write found it short
        stay in the table, so a retry after freeing others takes only what is still missing.
        """
        blocks = self._blocks[seq.seq_id]  # (every sequence has its record from `add` on: no fallback to look up)
        table, bs = blocks.table, self.block_size
        computed = seq.num_computed if num_computed is None else num_computed
        end = computed + num_new_tokens
        if num_new_tokens == 1 and end <= len(table) * bs and self.pool.ref_counts[table[(end - 1) // bs]] == 1:
            return []  # a decode writing into a block of its own: nothing to allocate or copy
        fresh = computed // bs >= len(table)  # every block written is allocated now (admission): none shared
        try:
            table.extend(self.pool.allocate(self._blocks_needed(computed, num_new_tokens, len(table))))
            return [] if fresh else self._copy_on_write(blocks, computed, num_new_tokens)
        except OutOfBlocksError:
            return None

    def _copy_on_write(self, blocks: SequenceBlocks, num_computed: int, num_new_tokens: int) -> list[CopiedBlock]:
        bs, table = self.block_size, blocks.table
        first, last = num_computed // bs, (num_computed + num_new_tokens - 1) // bs
        shared = [i for i in range(first, last + 1) if self.pool.ref_counts[table[i]] > 1]
        if len(shared) > self.pool.num_free:
            raise OutOfBlocksError(f"copy-on-write needs {len(shared)} blocks, {self.pool.num_free} free")
        copies = []
        for i in shared:
            src, (dst,) = table[i], self.pool.allocate(1)
            self.pool.release([src])
            table[i] = dst
            copies.append(CopiedBlock(i, src, dst))
            if i < blocks.sent:  # the worker's table holds the old block there: it is told of the new one
                blocks.edits.append((i, dst))
        return copies

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list holds the blocks for `num_new_tokens` more tokens (copy-on-write aside)."""
        return self._blocks_needed(seq.num_computed, num_new_tokens, self.num_held(seq)) <= self.pool.num_free

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens' (speculative drafts the worker rejected, which
        the worker drops from its table by the same rule). Never registered: they hold no computed token."""
        blocks = self._blocks[seq.seq_id]
        keep = blocks_for(num_tokens, self.block_size)
        if len(blocks.table) > keep:
            self.pool.release(blocks.table[keep:])
            del blocks.table[keep:]
            blocks.sent = min(blocks.sent, keep)

    def take_unsent(self, seq: Sequence, arm_from: int = -1) -> tuple[KVBlocks, int]:
        """What the plan writer needs for one entry of the sequence: what the worker is still to be told of its
        table (blocks appended, copy-on-write edits), as sent from now on; and, with `arm_from` (its computed
        count once the entry is computed; -1: not asked), the token count up to which its decodes from there
        write into blocks it already holds alone (no allocation, no copy-on-write: `allocate_slots` returns [])
        and, with prefix caching, fill no block still to register (`register_full_blocks` has nothing to do
        after them); 0 if none. One call per entry: the plan writer's general path asks both."""
        blocks = self._blocks.get(seq.seq_id)
        if blocks is None:
            return NOTHING_NEW, 0
        table = blocks.table
        if len(table) == blocks.sent and not blocks.edits:
            unsent = NOTHING_NEW
        else:
            unsent = KVBlocks(table[blocks.sent:], blocks.edits)
            blocks.sent, blocks.edits = len(table), []
        if arm_from < 0:
            return unsent, 0
        bs = self.block_size
        first = arm_from // bs
        if first >= len(table):
            return unsent, 0
        ref_counts = self.pool.ref_counts
        for b in table[first:]:  # one or two blocks, mostly: a loop, not a generator
            if ref_counts[b] != 1:
                return unsent, 0
        if self.enable_prefix_caching:  # the blocks registered once the step computing up to `arm_from` is applied
            registered = max(blocks.registered, first)
            return unsent, min(len(table) * bs, (registered + 1) * bs - 1)
        return unsent, len(table) * bs

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs, blocks = self.block_size, self._blocks[seq.seq_id]
        if seq.num_computed < (blocks.registered + 1) * bs:
            return  # no block filled since the last call (most steps of a decode)
        full = min(seq.num_computed // bs, len(blocks.table))
        if full <= blocks.registered:
            return
        hashes = blocks.hashes
        if len(hashes) < full:
            extend_hashes(hashes, seq.packed(full * bs), bs, full, seq.info.cache_salt)
        for i in range(blocks.registered, full):
            self.pool.register(blocks.table[i], hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        blocks.registered = full

    def register_computed(self, entries: Iterable[tuple[Sequence, int]]) -> None:
        """`register_full_blocks` for each sequence of a step's (sequence, tokens) entries once they count as
        computed, in order; the check that a block filled since the last call is made here, inline (most entries
        filled none). One that ended since holds no record; one preempted or swapped holds no table to register."""
        if not self.enable_prefix_caching:
            return
        records, bs = self._blocks, self.block_size
        for seq, _ in entries:
            blocks = records.get(seq.seq_id)
            if blocks is not None and seq.num_computed >= (blocks.registered + 1) * bs:
                self.register_full_blocks(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child sample holds the parent's prompt blocks by reference (and knows their hashes)."""
        mine, bs = self._blocks[parent.seq_id], self.block_size
        prompt_blocks = mine.table[:blocks_for(parent.prompt_len, bs)]
        for b in prompt_blocks:
            self.pool.share(b)
        self._blocks[child.seq_id] = SequenceBlocks(prompt_blocks, list(mine.hashes),
                                                    min(mine.registered, (parent.prompt_len - 1) // bs))

    # ---------------------------------------------------------------- giving blocks back

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its table is empty afterwards (its hashes are kept for a later
        admission: its tokens have not changed)."""
        blocks = self._blocks.get(seq.seq_id)
        if blocks is None:
            return
        self.pool.release(blocks.table)
        blocks.table, blocks.edits = [], []
        blocks.sent = blocks.registered = blocks.host_blocks = 0

    def forget(self, seq: Sequence) -> None:
        """The sequence ended (or leaves this replica): its blocks freed and its record dropped."""
        blocks = self._blocks.pop(seq.seq_id, None)
        if blocks is not None and blocks.table:
            self.pool.release(blocks.table)

    def swap_out(self, seq: Sequence) -> list[int]:
        """Free the sequence's blocks; return those holding K/V, for the worker to copy to host first."""
        blocks = self._blocks[seq.seq_id]
        held = blocks.table[:blocks_for(seq.num_computed, self.block_size)]
        self.free(seq)
        blocks.host_blocks = len(held)
        return held

    def can_swap_in(self, seq: Sequence) -> bool:
        """Room for the swapped blocks and for the block the next token goes into."""
        next_token_blocks = blocks_for(seq.num_computed + 1, self.block_size)
        return self.can_allocate(max(self._blocks[seq.seq_id].host_blocks, next_token_blocks))

    def swap_in(self, seq: Sequence) -> list[int]:
        """Fresh blocks for the swapped K/V: the sequence's new table (not in the prefix cache), which the
        swap-in itself tells the worker."""
        blocks = self._blocks[seq.seq_id]
        blocks.table = self.pool.allocate(blocks.host_blocks)
        blocks.registered, blocks.host_blocks = 0, 0
        blocks.sent = len(blocks.table)
        return list(blocks.table)

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
            blocks = self._blocks.get(seq.seq_id)
            for i, b in enumerate(blocks.table if blocks is not None else ()):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_tokens - i * bs)))
        allocated_slots = len(fill) * bs
        held_tokens = sum(fill.values())
        return (allocated_slots - held_tokens) / allocated_slots if allocated_slots else 0.0
