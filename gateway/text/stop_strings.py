"""Stop-string matching over streamed text (OpenAI semantics: the stop string is not emitted).

A stop string can span several pushes, so the matcher holds back the tail of the stream that
could still begin a stop string. Each stop string keeps a KMP state (the length of the
longest suffix of the stream that is a prefix of it), so a feed costs O(len(text)) steps per
stop string, amortized, however the stream is split.

"Earliest" is the match that completes first in the stream: that is what a streaming matcher
can decide without waiting for more text, so the result does not depend on how the text is
split. Among stop strings completing at the same character the longest (earliest-starting)
wins, e.g. "\\n\\nUser:" over "User:".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # text safe to emit now
    stopped: bool  # a stop string matched; text ends right before it
    matched: str | None  # which stop string


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops: list[str] = list(dict.fromkeys(stop))  # dedupe, keep order
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)
        self._held = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    def feed(self, text: str) -> StopResult:
        if self._matched is not None:
            return StopResult("", True, self._matched)
        if not self._stops:
            return StopResult(text, False, None)
        buf = self._held + text
        base = len(self._held)  # the held chars are already accounted for in the states
        for pos in range(base, len(buf)):
            char = buf[pos]
            best: str | None = None
            for j, stop in enumerate(self._stops):
                k = self._state[j]
                while k and stop[k] != char:
                    k = self._fail[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    if best is None or len(stop) > len(best):
                        best = stop
                self._state[j] = k
            if best is not None:
                self._matched, self._held = best, ""
                return StopResult(buf[: pos + 1 - len(best)], True, best)
        # No future match can start before the longest partial match, so the rest is safe.
        hold = max(self._state)
        self._held = buf[len(buf) - hold :] if hold else ""
        return StopResult(buf[: len(buf) - hold], False, None)

    def flush(self) -> str:
        """End of stream: release the held-back tail (nothing once stopped)."""
        held, self._held = self._held, ""
        self._state = [0] * len(self._stops)
        return held
