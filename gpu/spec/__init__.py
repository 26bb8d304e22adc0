"""Speculative decoding on the worker: proposers of draft tokens (ngram.py) and their
verification (verify.py). The scheduler decides which rows may speculate and reserves their
slots (its speculation module); docs/architecture.md ("Speculative decoding") walks through a
step."""

from typing import Protocol

from conveyor.gpu.spec.ngram import NgramProposer
from conveyor.gpu.spec.verify import accepted_length


class Proposer(Protocol):
    def propose(self, histories: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        """histories[r]: row r's ids (prompt, outputs); max_drafts[r]: how many it may verify ->
        each row's drafts, at most that many (any may be empty)."""
        ...


__all__ = ["NgramProposer", "Proposer", "accepted_length"]
