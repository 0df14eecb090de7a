"""Chunked prefill: how much of a sequence's uncomputed tokens (a prompt, or a recompute's tokens) one step
computes, within the step's token budget, `max_prefill_chunk_tokens`, and `enable_chunked_prefill`."""

from __future__ import annotations

from hetero_common.config import Config
from scheduler_svc.sequence import Sequence


def chunk_size(config: Config, seq: Sequence, token_budget: int, num_computed: int | None = None) -> int:
    """How many of the sequence's uncomputed tokens (past `num_computed`, else its own count) fit this step
    (0 = none: without chunked prefill, all of them fit or none)."""
    remaining = seq.num_tokens - (seq.num_computed if num_computed is None else num_computed)
    if not config.enable_chunked_prefill:
        return remaining if remaining <= token_budget else 0
    cap = config.max_prefill_chunk_tokens or token_budget
    return min(remaining, token_budget, cap)
