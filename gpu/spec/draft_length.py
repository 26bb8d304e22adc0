"""How many drafts a row verifies: as many as pay for themselves, judged by the row's own recent
acceptance.

Verifying d drafts costs a pass of d + 1 positions, about 1 + c d decode steps (c: a draft
position's cost relative to a whole decode step; ROW_COST by device). If each draft holds with
probability a, given the ones before it held, the pass emits on average
E(d) = 1 + a + ... + a^d tokens, so it yields E(d) / (1 + c d) tokens per step's worth of time,
and d = 0 (a plain decode) yields 1. A row verifies the d <= k that maximises that, so text
the proposer copies well (code edits, quotes) takes every draft, and text it guesses badly
(open questions) soon takes none instead of paying for rejected ones.

a is estimated per sequence from its verifications: each draft that held is a success, the first
that did not a failure (the ones after it were never tried), counts decayed by DECAY per
verification so the estimate follows the text, and a prior of PRIOR_TRIALS trials at PRIOR_RATE.
A sequence that stopped verifying still gets a first draft now and then (PROBE_EVERY steps), so
a copy starting later in its text is noticed.
"""

from __future__ import annotations

import dataclasses

# A draft position's cost relative to a one-row decode step. CPU: SmolLM2 Q4_1 packed on 2
# cores, ops/bench/decode_profile.py --rows 1 against --rows 5: 17.9 against 31.9 ms, so
# (31.9 / 17.9 - 1) / 4 = 0.2. CUDA: an ESTIMATE (a small decode batch is bound by reading the
# weights, which extra rows share), not measured.
ROW_COST = {"cpu": 0.2, "cuda": 0.05}
DECAY = 0.6
PRIOR_RATE, PRIOR_TRIALS = 0.5, 1.0
PROBE_EVERY = 8


@dataclasses.dataclass
class Acceptance:
    """One sequence's record of its drafts."""

    held: float = 0.0  # drafts that held, decayed
    tried: float = 0.0  # drafts tried (held, plus the first that did not), decayed
    idle_steps: int = 0  # steps since it last verified a draft

    @property
    def rate(self) -> float:
        return (self.held + PRIOR_RATE * PRIOR_TRIALS) / (self.tried + PRIOR_TRIALS)

    def record(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts, the first `accepted` of which held."""
        tried = accepted + (1 if accepted < drafted else 0)
        self.held = self.held * DECAY + accepted
        self.tried = self.tried * DECAY + tried
        self.idle_steps = 0

    def draft_length(self, k: int, row_cost: float) -> int:
        """The d <= k that maximises expected tokens per unit of time (module docstring)."""
        rate = self.rate
        best, best_yield, emitted = 0, 1.0, 1.0
        term = 1.0
        for d in range(1, k + 1):
            term *= rate
            emitted += term
            if emitted / (1 + row_cost * d) > best_yield:
                best, best_yield = d, emitted / (1 + row_cost * d)
        if best == 0:
            self.idle_steps += 1
            if self.idle_steps >= PROBE_EVERY:  # a probe: one draft, to see whether copying began
                self.idle_steps = 0
                return 1
        return best
