"""How many drafts a row verifies (gpu/spec/draft_length.py): all k while its drafts hold, none
once they keep failing (with a probe now and then), and the choice maximises expected tokens per
unit of time against a brute-force expectation."""

from __future__ import annotations

import itertools

import pytest

from conveyor.gpu.spec.draft_length import PROBE_EVERY, Acceptance


def expected_yield(rate: float, d: int, cost: float) -> float:
    """Tokens per unit of time, by enumerating every outcome of d drafts."""
    total = 0.0
    for outcome in itertools.product([True, False], repeat=d):
        p, emitted = 1.0, 1
        for held in outcome:
            p *= rate if held else 1 - rate
        for held in outcome:
            if not held:
                break
            emitted += 1
        total += p * emitted
    return total / (1 + cost * d)


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.5, 0.7, 0.85, 0.97])
@pytest.mark.parametrize("cost", [0.05, 0.2, 0.5])
def test_the_choice_maximises_the_expected_yield(rate, cost):
    record = Acceptance(held=rate * 1e6, tried=1e6)  # the prior drowned out
    d = record.draft_length(6, cost)
    best = max(range(7), key=lambda n: expected_yield(rate, n, cost))
    assert expected_yield(rate, d, cost) == pytest.approx(expected_yield(rate, best, cost))


def test_drafts_that_hold_earn_all_k_and_failing_ones_none_but_a_probe():
    record = Acceptance()
    assert record.draft_length(4, 0.2) == 1  # the prior alone: a coin's odds
    for _ in range(8):  # the flow: verify what the record says is worth it, every draft holding
        d = record.draft_length(4, 0.2) or 1
        record.record(d, d)
    assert record.draft_length(4, 0.2) == 4
    steps = 0
    while (d := record.draft_length(4, 0.2)) > 0:  # now every draft fails
        record.record(d, 0)
        steps += 1
    assert steps <= 8
    lengths = [record.draft_length(4, 0.2) for _ in range(2 * PROBE_EVERY)]
    assert lengths.count(1) == 2 and lengths[PROBE_EVERY - 2] == lengths[-2] == 1 and lengths.count(0) == 2 * PROBE_EVERY - 2
    for _ in range(4):  # the probe held: a copy began, and the row takes drafts again
        d = record.draft_length(4, 0.2) or 1
        record.record(d, d)
    assert record.draft_length(4, 0.2) >= 3
