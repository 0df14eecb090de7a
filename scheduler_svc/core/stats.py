"""The scheduler's figures: the block pool of one core scheduler, the pools of every replica
merged into one, and the service's own counters (workers, rejections, routing, recovery)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sized

from hetero.v1 import common_pb2
from hetero_common.expert_load import add_expert_load
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence
from scheduler_svc.speculation.speculation import Speculator


class PoolOwner(Protocol):
    """What a pool's figures are read from: a core scheduler (a protocol, so that this module
    does not import the scheduler, which imports it)."""

    kv_cache: KVCacheManager
    running: list[Sequence]
    waiting: Sized
    swapped: Sized
    num_preemptions: int
    num_planned_ahead: int
    step_id: int
    suspended: bool
    speculator: Speculator | None

# Pool figures that add up across replicas; the others are merged by `merge_pools` below.
SUMMED_POOL_FIELDS = ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "num_running", "num_waiting",
                      "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_swapped",
                      "steps_planned_ahead", "spec_draft_tokens", "spec_accepted_tokens", "spec_drafted_decodes")


def pool_stats(s: PoolOwner) -> common_pb2.PoolStats:
    kv, spec = s.kv_cache, s.speculator
    stats = common_pb2.PoolStats(
        block_size=kv.block_size, total_blocks=kv.num_blocks, used_blocks=kv.num_used, free_blocks=kv.num_free,
        cached_blocks=kv.num_cached_free, usage=kv.usage, num_running=len(s.running),
        num_waiting=len(s.waiting), num_preemptions=s.num_preemptions, internal_waste=kv.internal_waste(s.running),
        steps=s.step_id, prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_swapped=len(s.swapped), suspended=s.suspended, steps_planned_ahead=s.num_planned_ahead,
    )
    if spec is not None:
        stats.spec_draft_tokens, stats.spec_accepted_tokens = spec.num_proposed, spec.num_accepted
        stats.spec_drafted_decodes = spec.num_drafted_rows
    return stats


def merge_pools(pools: Iterable[common_pb2.PoolStats]) -> common_pb2.PoolStats:
    """The replicas' pools as one: counts summed (the experts' loads too), steps the most any replica ran,
    suspended when any is, usage over all blocks, internal waste weighted by each pool's used blocks."""
    total = common_pb2.PoolStats()
    waste_weighted = 0.0
    for pool in pools:
        for name in SUMMED_POOL_FIELDS:
            setattr(total, name, getattr(total, name) + getattr(pool, name))
        total.steps = max(total.steps, pool.steps)
        total.block_size = pool.block_size or total.block_size
        total.suspended = total.suspended or pool.suspended
        waste_weighted += pool.internal_waste * pool.used_blocks
        add_expert_load(total, pool)
    total.usage = total.used_blocks / total.total_blocks if total.total_blocks else 0.0
    total.internal_waste = waste_weighted / total.used_blocks if total.used_blocks else 0.0
    return total


@dataclass
class ServiceCounters:
    """What the scheduler service counts itself; each replica counts the deadlines its engine
    loop expires, and `ServiceStats` reports the sum."""

    num_deadline_exceeded: int = 0  # orphans and callers gone past their deadline
    num_rejected_queue_full: int = 0
    num_recovered_sequences: int = 0
