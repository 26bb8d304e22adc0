"""Grammars as the step meets them (a StepFeature): a constrained sequence's (params.structured)
matcher on the rank that samples, created when the worker takes the sequence (a resumed one fed
the outputs the host has seen, a fork its own), and each pass's token mask, one row per logits
row: a verifying row's position j masked as if its first j drafts were drawn. The matcher takes
each drawn id in gpu/step/passes.py `pass_result`; speculation verifies only the drafts it allows.

Invariant: every rank waits alike for the ids in flight (what it collects decides its next
passes); only the sampling rank holds matchers and masks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.config.model import ModelConfig
from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.passes import PassWork, WorkerSeq
from conveyor.gpu.structured import TokenMask, grammars_for, token_mask
from conveyor.wire.step import NewSeq


class GrammarStep(StepFeature):
    def __init__(self, model: ModelConfig, tp: TensorParallel, device: torch.device) -> None:
        self.model, self.samples, self.device = model, tp.samples, device
        self.constrained: set[int] = set()  # seq_ids of the sequences whose params.structured is set

    def register(self, seq: WorkerSeq, new: NewSeq | None) -> None:
        if seq.params.structured is None:
            return
        self.constrained.add(seq.seq_id)
        if self.samples:  # replayed: the outputs the host has seen (a fork: its parent's, then its own draw)
            seq.matcher = grammars_for(self.model).matcher(seq.params.structured, seq.token_ids[seq.num_prompt_tokens :])

    def drop(self, seq_id: int) -> None:
        self.constrained.discard(seq_id)

    def mask(self, work: PassWork, settle: Callable[[], None]) -> TokenMask | None:
        """Called while the device computes the pass: the constrained rows' ids in flight are
        collected first (their matchers must have taken every earlier draw), then their matchers
        fill the bitmask. A row whose sequence stopped meanwhile draws unmasked: that draw is
        dropped anyway."""
        if not self.constrained or not any(work.rows[i].params.structured is not None for i in work.sampling):
            return None
        rows = work.logit_rows()
        if any(seq.params.structured is not None and seq.num_tokens > len(seq.token_ids) for seq, _ in rows):
            settle()
        if not self.samples:
            return None
        matchers = [None if seq.stopped or seq.matcher is None else (seq.matcher, drafts) for seq, drafts in rows]
        return token_mask(matchers, self.model.vocab_size, self.device)
