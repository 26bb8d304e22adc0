"""The n-gram proposer: the longest suffix (prompt_lookup_max down to _min) that occurred before,
its latest occurrence, the tokens after it, cut to each row's limit; checked against a plain
loop on random histories of mixed lengths in one batch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from conveyor.config.speculative import SpeculativeConfig
from conveyor.gpu.spec import NgramProposer


def proposer(low: int, high: int) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", 8, low, high))


def naive(history: list[int], limit: int, low: int, high: int) -> list[int]:
    """The rule, one token at a time."""
    if limit <= 0:
        return []
    for n in range(high, low - 1, -1):
        if n >= len(history):
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):  # latest first; a token must follow
            if history[start : start + n] == suffix:
                return history[start + n : start + n + limit]
    return []


def test_it_copies_what_followed_the_latest_match():
    p = proposer(2, 3)
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurs at 0 and 6; the latest is followed by 7, 1, 2, 3.
    assert p.lookup([history], [3]) == [[7, 1, 2]]


def test_a_longer_match_wins_over_a_later_shorter_one():
    p = proposer(1, 3)
    history = [8, 5, 6, 11, 12, 7, 6, 13, 8, 5, 6]
    # [8, 5, 6] occurs at 0 (followed by 11); the 1-gram [6] occurs later, at 6 (followed by 13).
    assert p.lookup([history], [2]) == [[11, 12]]


def test_no_match_no_limit_or_a_short_history_proposes_nothing():
    p = proposer(2, 4)
    assert p.lookup([[1, 2, 3, 4], [1, 2, 1, 2], [7]], [4, 0, 4]) == [[], [], []]


def test_a_draft_stops_at_the_end_of_the_history():
    assert proposer(1, 1).lookup([[4, 4, 4]], [5]) == [[4]]


@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 4), min_size=0, max_size=40), st.integers(0, 6)),
        min_size=1,
        max_size=6,
    ),
    low=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_the_batched_search_equals_the_plain_rule(rows, low, extra):
    histories, limits = [h for h, _ in rows], [k for _, k in rows]
    got = proposer(low, low + extra).lookup(histories, limits)
    assert got == [naive(h, k, low, low + extra) for h, k in rows]
