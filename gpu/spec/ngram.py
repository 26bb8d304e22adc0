"""N-gram prompt lookup: draft the tokens that followed the last place the sequence's newest
n tokens occurred before, in its prompt or its output (prompt lookup decoding).

For each row, n runs from prompt_lookup_max down to prompt_lookup_min and the first n with a
match wins; among matches of that n the latest is taken (the freshest context a copy is being
made from). The search is numpy over all rows at once: the histories right-aligned in one
[R, L] array (padding -1, which no token id equals), every window of n compared with the
suffix in one broadcast, [R, L - n, n]. No Python loop over tokens, one over n.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from conveyor.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from conveyor.gpu.step.passes import WorkerSeq


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int]) -> list[list[int]]:
        """The Proposer protocol (gpu/spec/__init__.py): a lookup over each row's ids."""
        return self.lookup([seq.token_ids for seq in seqs], max_drafts)

    def lookup(self, histories: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        """histories[r]: row r's token ids (prompt, then outputs); max_drafts[r]: how many it may
        verify (0: none). -> each row's drafts, at most max_drafts[r], possibly none."""
        wanted = [r for r, k in enumerate(max_drafts) if k > 0 and len(histories[r]) > self.min_n]
        drafts: list[list[int]] = [[] for _ in histories]
        if not wanted:
            return drafts
        width = max(len(histories[r]) for r in wanted)
        h = np.full((len(wanted), width), -1, dtype=np.int64)  # right-aligned: every suffix ends at column width - 1
        for i, r in enumerate(wanted):
            h[i, width - len(histories[r]) :] = histories[r]
        start = np.full(len(wanted), -1, dtype=np.int64)  # column where the draft begins; -1: no match yet
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            open_rows = np.flatnonzero(start < 0)
            if open_rows.size == 0:
                break
            rows = h[open_rows]
            # Windows that start at 0 .. width - n - 1 end before the last column, so a token follows each.
            windows = sliding_window_view(rows[:, :-1], n, axis=1)  # [R', width - n, n]
            hits = (windows == rows[:, None, -n:]).all(axis=2)  # [R', width - n]
            found = hits.any(axis=1)
            latest = width - n - 1 - np.argmax(hits[:, ::-1], axis=1)  # the last hit's window start
            start[open_rows[found]] = latest[found] + n
        for i, r in enumerate(wanted):
            if start[i] >= 0:
                drafts[r] = h[i, start[i] : start[i] + max_drafts[r]].tolist()
        return drafts
