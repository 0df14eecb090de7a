"""Prompt-lookup proposals for speculative decoding (issue 40's `ngram` method): match the last n tokens of a
sequence against its own earlier tokens (prompt and output) and propose the tokens that followed there.

No model: an index per sequence maps each n-gram (for every n in [min_n, max_n]) to where the tokens after
its most recent earlier occurrence start. Appending a token costs one index update per n, so a sequence's
index is built once over its prompt and then kept current step by step instead of rescanning the whole
history at every step (a 4,000-token context at 64 sequences would be 256,000 comparisons per n per step).

The longest n that matches wins (a longer match predicts the continuation better); among occurrences of
that n-gram, the most recent (text that repeats, repeats its latest form: the current loop of an agent, the
last revision of a passage being rewritten). Proposals are deterministic given the tokens, so a recompute
after preemption proposes the same.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's tokens and the index of its n-grams' most recent continuations."""

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        # n -> n-gram -> the position of the token that followed its most recent occurrence
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        """Add the sequence's next token: the n-grams ending just before it now have a continuation."""
        position = len(self._tokens)
        self._tokens.append(token)
        for n, table in self._next.items():
            if position >= n:
                table[tuple(self._tokens[position - n:position])] = position

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def truncate(self, length: int) -> None:
        """Drop the tokens from `length` on (a stop trimmed them, or they were rolled back) and rebuild the
        index over what is left: entries may point into the dropped tail."""
        if length < len(self._tokens):
            kept = self._tokens[:length]
            self._tokens = []
            for table in self._next.values():
                table.clear()
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix
        (min_n to max_n tokens); [] when none matches or k <= 0. Fewer than k when that occurrence is
        followed by fewer tokens."""
        if k <= 0:
            return []
        length = len(self._tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next[n].get(tuple(self._tokens[length - n:]))
            if start is not None:
                return self._tokens[start:start + k]
        return []

