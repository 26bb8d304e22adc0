"""What one scheduling decision produces (ScheduledStep) and what a step's result changes
(SeqUpdate). stages/scheduler/plan.py turns these into wire messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from conveyor.stages.scheduler.sequence import Sequence
from conveyor.wire.messages import FinishReason, TokenLogprob


@dataclasses.dataclass(slots=True)
class Row:
    seq: Sequence
    num_tokens: int  # tokens of the sequence computed this step
    new_block_ids: list[int]  # appended to the worker's block table
    replaced_blocks: list[tuple[int, int]]  # (table position, new block): copy-on-write
    samples: bool = False  # the chunk reaches the last known token: one token is drawn
    forks: list[Sequence] = dataclasses.field(default_factory=list)  # siblings drawn from it
    # The sequence's preemption count when planned: a draw coming back to a sequence preempted
    # (and perhaps started again) since then is stale.
    epoch: int = 0


@dataclasses.dataclass
class ScheduledStep:
    step: int
    rows: list[Row]
    new_seqs: list[Sequence]  # sequences the worker sees for the first time (or after preemption)
    new_seqs_computed: list[int]  # per new sequence: tokens already in the cache (prefix hit)
    copy_blocks: list[tuple[int, int]]  # (src, dst) block copies before the forward
    finished_seq_ids: list[int]  # sequences the worker may forget
    num_tokens: int
    num_sampled: int  # ids the step's result must carry: one per sampling row, one per fork

    def draws(self) -> Iterator[tuple[Row, Sequence]]:
        """(row, sequence) of each draw, in the order the result carries their ids: each sampling
        row's own sequence, then its forks."""
        for row in self.rows:
            if row.samples:  # else a prompt chunk short of the end
                yield row, row.seq
                for child in row.forks:
                    yield row, child

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens computed for prompts (and recomputation) rather than decodes."""
        return sum(r.num_tokens for r in self.rows if r.num_tokens > 1 or not r.samples)


@dataclasses.dataclass(slots=True)
class SeqUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when the request asked
    # The detokenizer's first update of the sequence: its batch carries the sequence's DetokSeq.
    new_to_detokenizer: bool = False
