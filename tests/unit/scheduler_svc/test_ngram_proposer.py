"""The n-gram (prompt-lookup) proposer's index against a scan of the whole history, on hand-made and random
token sequences, appended one token at a time and truncated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from scheduler_svc.speculation.ngram_proposer import NgramIndex


def propose_brute_force(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix of min_n..max_n tokens with an earlier occurrence; its most recent one's next k."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        for end in range(length - 1, n - 1, -1):  # an occurrence ending just before `end`, followed by tokens[end]
            if list(tokens[end - n:end]) == suffix:
                return list(tokens[end:end + k])
    return []


def test_a_repeated_span_is_proposed_from_where_it_occurred() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    index = NgramIndex(1, 3, tokens)
    assert index.propose(3) == [8, 9, 1]  # "6 7" occurred at 1-2, followed by 8 9 1
    assert index.propose(1) == [8]
    assert index.propose(0) == []


def test_the_longest_match_wins_then_the_most_recent_occurrence() -> None:
    # "3" alone last occurred before 9; "2 3" occurred before 4 only.
    index = NgramIndex(1, 2, [2, 3, 4, 0, 3, 9, 1, 2, 3])
    assert index.propose(1) == [4]
    index = NgramIndex(1, 1, [2, 3, 4, 0, 3, 9, 1, 2, 3])
    assert index.propose(1) == [9]


def test_no_match_and_a_short_continuation() -> None:
    assert NgramIndex(2, 3, [1, 2, 3, 4]).propose(4) == []
    assert NgramIndex(1, 1, []).propose(2) == []
    index = NgramIndex(1, 2, [7, 8, 7])
    assert index.propose(5) == [8, 7]  # the occurrence is followed by two tokens only


def test_truncation_forgets_the_dropped_tokens() -> None:
    index = NgramIndex(1, 2, [1, 2, 3, 1, 2, 4])
    index.truncate(4)  # [1, 2, 3, 1]
    assert index.propose(3) == [2, 3, 1]
    index.append(2)
    assert index.propose(2) == [3, 1]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_proposes_what_a_full_scan_proposes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: many repeats, many ties between occurrences
    min_n = int(rng.integers(1, 3))
    max_n = min_n + int(rng.integers(0, 3))
    tokens = [int(t) for t in rng.integers(0, vocab, 12)]
    index = NgramIndex(min_n, max_n, tokens)
    for _ in range(80):
        k = int(rng.integers(0, 6))
        assert index.propose(k) == propose_brute_force(tokens, k, min_n, max_n)
        if rng.random() < 0.1 and len(tokens) > 3:
            keep = int(rng.integers(1, len(tokens)))
            tokens = tokens[:keep]
            index.truncate(keep)
        token = int(rng.integers(0, vocab))
        tokens.append(token)
        index.append(token)
        assert len(index) == len(tokens)
