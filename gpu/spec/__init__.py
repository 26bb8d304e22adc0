"""Speculative decoding on the worker (the step meets it as its speculation feature, gpu/step/features/): proposers of draft
tokens (ngram.py, draft_model.py, eagle3.py over eagle3_head.py; the model-based ones run their
passes through draft_passes.py), how many a row verifies (draft_length.py) and their
verification (verify.py). The scheduler decides which rows may speculate and reserves their
slots (its speculation module); docs/architecture.md ("Speculative decoding") walks through a
step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from conveyor.gpu.spec.ngram import NgramProposer
from conveyor.gpu.spec.verify import accepted_length

if TYPE_CHECKING:
    from conveyor.gpu.step.passes import WorkerSeq


class Proposer(Protocol):
    def propose(self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int]) -> list[list[int]]:
        """seqs: decoding rows whose ids are all on the host (their last token not computed yet),
        slots: their rows of the persistent batch, max_drafts[r]: how many row r may verify ->
        each row's drafts, at most that many (any may be empty)."""
        ...


__all__ = ["NgramProposer", "Proposer", "accepted_length"]
