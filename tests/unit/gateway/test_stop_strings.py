from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.stop_strings import StopResult, StopStringMatcher


def reference(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Whole-text semantics, brute force: the match that completes first; at equal ends the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            best = max(done, key=len)
            return text[: end - len(best)], best
    return text, None


def stream(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, str | None, list[StopResult]]:
    matcher = StopStringMatcher(stops)
    results = [matcher.feed(p) for p in pieces]
    out = "".join(r.text for r in results)
    matched = next((r.matched for r in results if r.stopped), None)
    if matched is None:
        out += matcher.flush()
    return out, matched, results


def test_spans_several_pushes() -> None:
    out, matched, results = stream(["Hi", "\n", "\nUs", "er:", " more"], ["\n\nUser:"])
    assert (out, matched) == ("Hi", "\n\nUser:")
    assert [r.text for r in results] == ["Hi", "", "", "", ""]
    assert [r.stopped for r in results] == [False, False, False, True, True]


def test_holds_only_a_possible_stop_prefix() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("a\nb").text == "a\nb"  # "\nb" cannot start the stop string
    assert matcher.feed("c\n").text == "c"
    assert matcher.feed("x").text == "\nx"  # the held "\n" was a false start
    assert matcher.feed("\n\nUse").text == ""
    assert matcher.flush() == "\n\nUse"


def test_stop_at_the_very_start() -> None:
    assert stream(["STOP and more"], ["STOP"])[:2] == ("", "STOP")
    assert stream(["S", "T", "OP"], ["STOP"])[:2] == ("", "STOP")


def test_overlapping_candidates() -> None:
    assert stream(["aaab"], ["aab"])[:2] == ("a", "aab")
    assert stream(["a", "a", "a", "b"], ["aab"])[:2] == ("a", "aab")
    assert stream(["abababac"], ["ababac"])[:2] == ("ab", "ababac")


def test_multiple_stops_earliest_wins() -> None:
    assert stream(["x END y STOP"], ["STOP", "END"])[:2] == ("x ", "END")
    # Same end: the longer one, so "\n\nUser:" is cut whole rather than leaving "\n\n".
    assert stream(["hi\n\nUser:"], ["User:", "\n\nUser:"])[:2] == ("hi", "\n\nUser:")
    # The first to complete wins even if a longer one started earlier.
    assert stream(["abcdef"], ["abcdef", "bcd"])[:2] == ("a", "bcd")


def test_no_stops_is_pass_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == StopResult("abc", False, None)
    assert matcher.flush() == ""


def test_empty_stop_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_unicode() -> None:
    assert stream(["東京", "🙂", "é"], ["🙂é"])[:2] == ("東京", "🙂é")
    assert stream(["東", "京🙂"], ["京"])[:2] == ("東", "京")


def test_after_stop_everything_is_dropped() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("a. b") == StopResult("a", True, ".")
    assert matcher.feed("more") == StopResult("", True, ".")
    assert matcher.flush() == ""


ALPHABET = "ab\n:é東🙂"
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=60), stops=stop_lists, data=st.data())
def test_random_splits_match_whole_text(text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    expected = reference(text, stops)
    assert stream([text], stops)[:2] == expected
    out, matched, results = stream(pieces, stops)
    assert (out, matched) == expected
    # Nothing is emitted that a later piece could make part of a stop string, and nothing more
    # is held back than the longest tail that could still start one.
    fed = emitted = ""
    for piece, r in zip(pieces, results):
        fed, emitted = fed + piece, emitted + r.text
        assert expected[0].startswith(emitted)
        if not r.stopped:
            held = fed[len(emitted) :]
            candidates = [fed[i:] for i in range(len(fed)) if any(s.startswith(fed[i:]) for s in stops)]
            assert held == max(candidates, key=len, default="")
