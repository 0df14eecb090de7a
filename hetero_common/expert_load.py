"""A mixture of experts' load, as the scheduler counts it from the workers' step results and the gateway shows it
(`hetero_moe_expert_tokens`, `hetero_moe_expert_step_tokens`): the tokens routed to each expert, and a histogram
of the tokens one expert took in one step. An even load keeps every expert's step counts near tokens x k /
experts; a router that favours a few experts shows as a long tail here and as a few large totals."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from hetero.v1 import common_pb2

# Upper bounds (inclusive) of the histogram's buckets, in tokens per expert per step; one more bucket above.
STEP_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExpertLoad:
    """What one replica's steps routed to the experts (its StepResults' `expert_tokens`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # per expert, since the start
        self.buckets = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self.step_tokens_sum = 0

    def observe(self, step_tokens: Sequence[int]) -> None:
        """One step's tokens per expert (empty for a dense model: nothing to count)."""
        if len(self.tokens) < len(step_tokens):
            self.tokens += [0] * (len(step_tokens) - len(self.tokens))
        for expert, count in enumerate(step_tokens):
            self.tokens[expert] += count
            self.buckets[bisect_left(STEP_TOKEN_BUCKETS, count)] += 1
        self.step_tokens_sum += sum(step_tokens)

    def fill(self, pool: common_pb2.PoolStats) -> None:
        """Into a pool's figures, where the model has experts."""
        if self.tokens:
            pool.expert_tokens[:] = self.tokens
            pool.expert_step_token_buckets[:] = self.buckets
            pool.expert_step_tokens_sum = self.step_tokens_sum


def add_expert_load(total: common_pb2.PoolStats, pool: common_pb2.PoolStats) -> None:
    """One replica's load added into `total` (the replicas' experts are the same model's)."""
    for field in ("expert_tokens", "expert_step_token_buckets"):
        mine, theirs = list(getattr(total, field)), list(getattr(pool, field))
        size = max(len(mine), len(theirs))
        summed = [a + b for a, b in zip(mine + [0] * (size - len(mine)), theirs + [0] * (size - len(theirs)))]
        getattr(total, field)[:] = summed
    total.expert_step_tokens_sum += pool.expert_step_tokens_sum
