"""Speculative decoding as the step meets it (a StepFeature): which drafts each row granted a
lookahead verifies this pass, and, with a draft model or an EAGLE-3 head, its KV cache kept in
step with the target's (sized, allocated and copied with it, and written after every pass). The
proposers, drafters and the rule a draft is kept by are gpu/spec/'s.

A row's drafts are at most its lookahead, as many as its own acceptance makes worth verifying
(draft_length.py; all of them with `"draft_length": "fixed"`), what its table holds past its
token, and what its request may still produce; a grammar's row verifies only the drafts its
grammar allows in turn (under tensor parallelism, where only rank 0 has matchers, none: the ranks
must decide alike from what they all hold).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.gpu.spec.draft_length import ROW_COST
from conveyor.gpu.spec.draft_model import DraftModel
from conveyor.gpu.spec.eagle3 import Eagle3Proposer
from conveyor.gpu.spec.ngram import NgramProposer
from conveyor.gpu.step.features.base import StepFeature
from conveyor.wire.stop_rules import tokens_left

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.gpu.models.base import CausalLM
    from conveyor.gpu.parallel.group import TensorParallel
    from conveyor.gpu.spec import Proposer
    from conveyor.gpu.step.passes import PassWork, WorkerSeq
    from conveyor.gpu.step.persistent_batch import PersistentBatch
    from conveyor.gpu.step.platform import Platform
    from conveyor.wire.step import ScheduledSeq, StepPlan


class SpeculationStep(StepFeature):
    def __init__(self, config: EngineConfig, platform: Platform, batch: PersistentBatch, tp: TensorParallel, target: CausalLM) -> None:
        assert config.speculative is not None
        self.batch, self.tp_size = batch, tp.size
        self.fixed = config.speculative.draft_length == "fixed"
        self.block_size, self.max_model_len = config.cache.block_size, config.model.max_model_len
        self.drafter: DraftModel | Eagle3Proposer | None = None
        self.proposer: Proposer
        if config.speculative.method == "draft_model":
            self.proposer = self.drafter = DraftModel(config, platform, batch, tp)
        elif config.speculative.method == "eagle3":
            self.proposer = self.drafter = Eagle3Proposer(config, platform, batch, tp, target)
        else:
            self.proposer = NgramProposer(config.speculative)
        # A draft position's cost in decode steps: verifying it, and (a draft model or head) proposing it.
        self.row_cost = ROW_COST.get(platform.device.type, ROW_COST["cpu"])
        if self.drafter is not None:
            self.row_cost += self.drafter.step_cost(target)

    # --- a draft model's or head's KV, beside the target's -------------------------------------

    def bytes_per_block(self) -> int:
        return self.drafter.passes.bytes_per_block() if self.drafter is not None else 0

    def allocate(self, num_blocks: int, kv_caches: list[torch.Tensor]) -> None:
        if self.drafter is not None:
            self.drafter.passes.allocate(num_blocks)

    def apply(self, plan: StepPlan) -> None:
        if self.drafter is not None:
            self.drafter.passes.copy_blocks(plan.copy_blocks)

    def after_forward(self, work: PassWork, hidden: torch.Tensor, first: bool) -> None:
        """After the target's pass: the draft's own pass over the same rows."""
        if self.drafter is not None:
            self.drafter.follow(work.inputs, work.rows)

    @property
    def runs_eagerly(self) -> bool:
        """Every pass runs eagerly with a drafter: it follows each with its metadata or hidden states."""
        return self.drafter is not None

    # --- drafts --------------------------------------------------------------------------------

    @torch.inference_mode()
    def drafts(self, rows: list[WorkerSeq], scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        """The drafts each row verifies this pass (by row index; rows without any left out).
        Every id of a row granted a lookahead is on the host, and a grammar's matcher has taken
        them all (`must_wait` saw to it)."""
        wanted = [i for i, row in enumerate(scheduled) if row.num_lookahead and not rows[i].stopped]
        if not wanted:
            return {}
        seqs = [rows[i] for i in wanted]
        limits = [self._limit(seq, scheduled[i].num_lookahead) for i, seq in zip(wanted, seqs)]
        proposed = self.proposer.propose(seqs, [self.batch.slots[seq.seq_id] for seq in seqs], limits)
        for n, seq in enumerate(seqs):  # a grammar's row verifies only the drafts its grammar allows
            if seq.matcher is not None and proposed[n]:
                proposed[n] = proposed[n][: seq.matcher.allowed_drafts(proposed[n])]
        return {i: d for i, d in zip(wanted, proposed) if d}

    def must_wait(self, seq: WorkerSeq, row: ScheduledSeq | None) -> bool:
        """A row verifying drafts counts its own token alone until its result lands, and drafts
        are proposed from every id."""
        return seq.verifying or (row is not None and row.num_lookahead > 0)

    def _limit(self, seq: WorkerSeq, lookahead: int) -> int:
        # Past the token this pass draws: what its request may still take, counting the ids the
        # device holds (the scheduler's count, speculation.py, may lag by in-flight acceptances).
        left = tokens_left(seq.params, seq.num_tokens, seq.num_prompt_tokens, self.max_model_len) - 1
        room = len(seq.block_table) * self.block_size - seq.num_computed - 1
        worth = lookahead if self.fixed else seq.acceptance.draft_length(lookahead, self.row_cost)
        if seq.params.structured is not None and self.tp_size > 1:
            worth = 0
        return max(0, min(worth, left, room))
