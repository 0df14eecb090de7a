"""Data-parallel routing: which worker replica a new request goes to.

Policies (Megatron's names): `round_robin`; `longest_prefix`, the replica that holds the
longest run of the prompt's leading full blocks; `first_prefix_block`, a replica that holds
the prompt's first full block. Load (running + waiting sequences) breaks ties.

Each replica's prefix content is tracked here by the router's own index: the hashes of the
full prompt blocks routed to that replica, capped at the replica's pool size (oldest
forgotten first). They are the prefix cache's own block hashes (chained, salted with the
request's cache salt), so the index approximates what the replica's prefix cache would hold.
Its counters say "of the prompt's full blocks, how many were already routed to the chosen
replica", not the prefix cache's own hit rate.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from scheduler_svc.kv.prefix_cache import block_hashes


@dataclass
class PrefixIndex:
    """One replica's routed prompt blocks, least recently used first."""

    capacity: int
    entries: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt this replica holds."""
        n = 0
        for h in hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.entries[h] = None
            self.entries.move_to_end(h)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


@dataclass
class RouteDecision:
    replica: int
    prompt_blocks: int  # full blocks in the prompt
    matched_blocks: int  # of which the chosen replica already held (router index)
    block_hashes: list[bytes]  # the prefix cache's hashes of the prompt's full blocks: the replica reuses them


class Router:
    def __init__(self, policy: str, block_size: int, num_replicas: int, capacity_blocks: int = 1 << 16) -> None:
        if policy not in ("round_robin", "longest_prefix", "first_prefix_block"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.indexes = [PrefixIndex(capacity_blocks) for _ in range(num_replicas)]
        self._next = 0
        self.blocks_queried = 0
        self.blocks_hit = 0

    def add_replica(self) -> int:
        """A replica that joined later (worker_dns): the next index."""
        self.indexes.append(PrefixIndex(self.capacity_blocks))
        return len(self.indexes) - 1

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        self.indexes[replica].capacity = max(1, capacity_blocks)

    def forget(self, replica: int) -> None:
        """The replica lost its KV cache (failed or restarted)."""
        self.indexes[replica].clear()

    def choose(self, token_ids: Sequence[int], candidates: list[int], loads: dict[int, int],
               cache_salt: str = "") -> RouteDecision:
        """Pick one of `candidates` (replica indexes that are up) and record the prompt there.

        `cache_salt`: the request's, so that only prompts the prefix cache could share match."""
        if not candidates:
            raise ValueError("no replica to route to")
        hashes = block_hashes(token_ids, self.block_size, cache_salt)
        matched = {r: self.indexes[r].matched(hashes) for r in candidates}
        rotation = {r: (r - self._next) % len(self.indexes) for r in candidates}  # round-robin order as last tie-break
        if self.policy == "round_robin":
            chosen = min(candidates, key=lambda r: rotation[r])
        elif self.policy == "longest_prefix":
            chosen = min(candidates, key=lambda r: (-matched[r], loads.get(r, 0), rotation[r]))
        else:  # first_prefix_block
            chosen = min(candidates, key=lambda r: (-min(matched[r], 1), loads.get(r, 0), rotation[r]))
        self._next = (chosen + 1) % len(self.indexes)
        self.indexes[chosen].add(hashes)
        self.blocks_queried += len(hashes)
        self.blocks_hit += matched[chosen]
        return RouteDecision(chosen, len(hashes), matched[chosen], hashes)
