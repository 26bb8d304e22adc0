"""Matcher: one constrained sequence's place in its grammar, on the worker's host.

It takes the sequence's sampled ids in order (`accept`), as they reach the host, and writes the
ids allowed next into its row of a pass's bitmask (`fill`: bit j of row r set = id j allowed).
Once the grammar is complete the only ids allowed are the model's EOS ids; after one of them is
accepted the matcher has terminated and still allows only those (a sequence with ignore_eos goes
on drawing EOS until max_tokens; xgrammar itself would refuse to fill a terminated matcher).
"""

from __future__ import annotations

import logging

import torch
import xgrammar as xgr

log = logging.getLogger(__name__)


class Matcher:
    def __init__(self, grammar: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(grammar)
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self.num_rejected = 0  # ids drawn outside the grammar: a bug, or a draw that failed

    @property
    def is_terminated(self) -> bool:
        """Whether it accepted an EOS id: the grammar is done and so is the sequence."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by the sequence's next id; False (and no change) for an id the grammar does not
        allow there."""
        if self._matcher.is_terminated():  # a draw after EOS (ignore_eos, or a stale one)
            return False
        if not 0 <= token_id < self.vocab_size or not self._matcher.accept_token(token_id):
            self.num_rejected += 1
            if self.num_rejected == 1:
                log.warning("grammar matcher: id %d not allowed after %d accepted ids", token_id, self.num_accepted)
            return False
        self.num_accepted += 1
        return True

    def allowed_drafts(self, drafts: list[int]) -> int:
        """How many of `drafts`, from the first, the grammar allows in turn (speculative
        decoding cuts the rest before verifying); the matcher is left as it was."""
        allowed = 0
        for token in drafts:
            if self._matcher.is_terminated() or not 0 <= token < self.vocab_size or not self._matcher.accept_token(token):
                break
            allowed += 1
        if allowed:
            self._matcher.rollback(allowed)
        return allowed

    def fill_after(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """`fill` as if `drafts` (which allowed_drafts allowed) had been accepted: the mask of a
        verified draft position. The matcher is left as it was."""
        for token in drafts:
            self._matcher.accept_token(token)
        self.fill(bitmask, row)
        if drafts:
            self._matcher.rollback(len(drafts))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [R, ceil(V / 32)] int32 on the host: row `row` := the ids allowed next."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row] = 0
        for token in self._matcher.stop_token_ids:
            bit = 1 << (token % 32)
            bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32
