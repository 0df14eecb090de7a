"""A request's prompt logprobs (SamplingParams.prompt_logprobs), put together from the worker's
per-step entries and sent on its first token event.

The worker scores the prompt positions each step computes (one entry per chunk, chunked
prefill). Entries are stored by position, not appended: after a recompute preemption before
the first token (or a worker lost mid-prefill) the prompt is computed again from its start,
and its entries land on the same positions with the same values, so nothing is duplicated
or lost. Only sample 0 of an n > 1 request carries them.

Prefix caching: cached positions were never computed, so they have no logits. A request that
still needs its prompt logprobs takes no prefix-cache hit at admission (it still registers the
blocks it computes, for others). Recomputing the cached positions would cost the same forward
work as not using the hit, so skipping the lookup is the simpler equal (README, "Prompt logprobs").
"""

from __future__ import annotations

import structlog

from hetero.v1 import common_pb2, worker_pb2

log = structlog.get_logger("scheduler_svc.core.prompt_logprobs")


class PromptLogprobs:
    """Prompt tokens 1..L-1's logprobs and top alternatives, filled by position."""

    __slots__ = ("logprobs", "top", "missing")

    def __init__(self, prompt_len: int) -> None:
        size = max(0, prompt_len - 1)
        self.logprobs: list[float] = [0.0] * size
        self.top: list[common_pb2.TopLogprobs | None] = [None] * size
        self.missing = set(range(size))  # indices (position - 1) not scored yet

    def add(self, entry: worker_pb2.PromptLogprobs) -> None:
        start, k = entry.first_position - 1, entry.num_top
        ids, values = entry.top_token_ids, entry.top_logprobs
        for j, value in enumerate(entry.logprobs):
            i = start + j
            if i >= len(self.logprobs):
                break
            self.logprobs[i] = value
            self.top[i] = common_pb2.TopLogprobs(token_ids=ids[j * k:(j + 1) * k], logprobs=values[j * k:(j + 1) * k])
            self.missing.discard(i)

    def take(self, request_id: str) -> tuple[list[float], list[common_pb2.TopLogprobs]]:
        """The values for the first token event. A gap would be a scheduler bug: logged, never
        hidden (the gap's entries are 0.0 with no alternatives)."""
        if self.missing:
            log.error("prompt logprobs incomplete at the first token", request_id=request_id,
                      missing_positions=sorted(p + 1 for p in self.missing)[:10], num_missing=len(self.missing))
        return self.logprobs, [t if t is not None else common_pb2.TopLogprobs() for t in self.top]

