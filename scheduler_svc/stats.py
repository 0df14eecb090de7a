"""Block pool figures for GetServerInfo: usage, prefix-cache counters and internal waste."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero.v1 import common_pb2

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler


def pool_stats(s: Scheduler) -> common_pb2.PoolStats:
    kv = s.kv_cache
    return common_pb2.PoolStats(
        block_size=kv.block_size, total_blocks=kv.num_blocks, used_blocks=kv.num_used, free_blocks=kv.num_free,
        cached_blocks=kv.num_cached_free, usage=kv.usage, num_running=len(s.running),
        num_waiting=len(s.waiting), num_preemptions=s.num_preemptions, internal_waste=kv.internal_waste(s.running),
        steps=s.step_id, prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_swapped=len(s.swapped), suspended=s.suspended,
    )
