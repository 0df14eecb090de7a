"""Block pool figures for GetServerInfo: usage, prefix-cache counters and internal waste."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero.v1 import common_pb2

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler


def pool_stats(s: Scheduler) -> common_pb2.PoolStats:
    """Internal waste: allocated token slots not holding a token / allocated slots (a shared
    block counted once, with the most tokens any of its holders keeps in it)."""
    bs = s.block_size
    fill: dict[int, int] = {}
    for seq in s.running:
        for i, b in enumerate(seq.block_table):
            fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_tokens - i * bs)))
    allocated_slots = len(fill) * bs
    held_tokens = sum(fill.values())
    pool = s.pool
    return common_pb2.PoolStats(
        block_size=bs, total_blocks=pool.num_blocks, used_blocks=pool.num_used, free_blocks=pool.num_free,
        cached_blocks=pool.num_cached_free, usage=pool.num_used / pool.num_blocks, num_running=len(s.running),
        num_waiting=len(s.waiting), num_preemptions=s.num_preemptions,
        internal_waste=(allocated_slots - held_tokens) / allocated_slots if allocated_slots else 0.0,
        steps=s.step_id, prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
        num_swapped=len(s.swapped), suspended=s.suspended,
    )
