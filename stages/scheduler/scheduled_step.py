"""What one scheduling decision produces (ScheduledStep) and what a step's result changes
(SeqUpdate). stages/scheduler/plan.py turns these into wire messages.

A step is one forward pass, or a multi-step window of `num_steps` decode passes
(stages/scheduler/windows.py): then a row's num_tokens is the passes it takes part in, and each
pass's result carries the draws of the rows still in it."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

from conveyor.stages.scheduler.sequence import SeqStatus, Sequence
from conveyor.wire.messages import FinishReason, PromptTokens, TokenLogprob
from conveyor.wire.step import LoraLoad, StepResult


@dataclasses.dataclass(slots=True)
class Row:
    seq: Sequence
    num_tokens: int  # tokens of the sequence computed this step (in a window: its passes, one token each)
    new_block_ids: list[int]  # appended to the worker's block table
    replaced_blocks: list[tuple[int, int]]  # (table position, new block): copy-on-write
    samples: bool = False  # the chunk reaches the last known token: one token is drawn
    forks: list[Sequence] = dataclasses.field(default_factory=list)  # siblings drawn from it
    # The sequence's preemption count when planned: a draw coming back to a sequence preempted
    # (and perhaps started again) since then is stale.
    epoch: int = 0
    # Draft tokens the worker may verify after the row's token (speculation.py): the row's
    # result is then a run of 1 to 1 + lookahead draws.
    lookahead: int = 0


@dataclasses.dataclass
class ScheduledStep:
    step: int
    rows: list[Row]
    new_seqs: list[Sequence]  # sequences the worker sees for the first time (or after preemption)
    new_seqs_computed: list[int]  # per new sequence: tokens already in the cache (prefix hit)
    copy_blocks: list[tuple[int, int]]  # (src, dst) block copies before the forward
    finished_seq_ids: list[int]  # sequences the worker may forget
    num_tokens: int  # tokens of one forward pass: the budget it spent (a window's first pass)
    num_sampled: int  # ids the step's results carry in all: per pass, one per sampling row and fork
    num_steps: int = 1  # forward passes: > 1 is a window of decodes
    num_passes_done: int = 0  # passes whose result the scheduler applied
    lora_loads: list[LoraLoad] = dataclasses.field(default_factory=list)  # adapters placed before the forward
    kv_saves: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (device block, host slot, name): kv_tiers.py
    kv_loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device block)
    kv_fetches: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (name, host slot) read from disk

    def draws(self, pass_index: int = 0) -> Iterator[tuple[Row, Sequence]]:
        """(row, sequence) of each draw of a pass: each sampling row's own sequence and its forks;
        in a window's pass k, the rows taking part in it (num_tokens > k), which never fork."""
        if self.num_steps > 1:
            for row in self.rows:
                if row.num_tokens > pass_index:
                    yield row, row.seq
            return
        for row in self.rows:
            if row.samples:  # else a prompt chunk short of the end
                yield row, row.seq
                for child in row.forks:
                    yield row, child

    def take_pass(self, result: StepResult) -> list[tuple[Row, Sequence]]:
        """The (row, sequence) of each draw a pass's result reports, found by its sequence id,
        once the result is checked against the step: passes come in order, the final one says
        last_pass, each of the pass's draws is reported once, failed and masked draws are draws
        of the result, and a masked draw's sequence no longer runs (the worker skips only a
        sequence that stopped earlier in the window, which its earlier result ended). Raises
        ValueError on a mismatch; else the pass counts as done."""
        k = result.pass_index
        where = f"step {self.step} pass {k}"
        if k != self.num_passes_done or k >= self.num_steps:
            raise ValueError(f"{where}: expected pass {self.num_passes_done} of {self.num_steps}")
        if k == self.num_steps - 1 and not result.last_pass:
            raise ValueError(f"{where}: the window's final pass does not say last_pass")
        expected = {seq.seq_id: (row, seq) for row, seq in self.draws(k)}
        seq_ids, num_ids = result.seq_ids, len(result.sampled_token_ids)
        # Each sequence's draws are one run: a single draw, or up to 1 + lookahead for a row that
        # verified drafts.
        runs = [seq_id for i, seq_id in enumerate(seq_ids) if i == 0 or seq_ids[i - 1] != seq_id]
        if len(seq_ids) != num_ids or len(runs) != len(expected) or expected.keys() != set(runs):  # once each
            raise ValueError(f"{where}: draws for sequences {seq_ids} ({num_ids} ids), expected {sorted(expected)}")
        if num_ids > len(runs):
            longest = collections.Counter(seq_ids)
            if any(n > 1 + expected[seq_id][0].lookahead for seq_id, n in longest.items()):
                raise ValueError(f"{where}: a run of draws longer than its row's lookahead allows: {seq_ids}")
        draws = [expected[seq_id] for seq_id in seq_ids]
        for name, indices in (("failed", result.failed_draws), ("masked", result.masked_draws)):
            if indices and not 0 <= min(indices) <= max(indices) < num_ids:
                raise ValueError(f"{where}: {name} draws {sorted(indices)} outside its {num_ids}")
        for draw in result.masked_draws:
            row, seq = draws[draw]
            if seq.status is SeqStatus.RUNNING and seq.num_preemptions == row.epoch:
                raise ValueError(f"{where}: draw {draw} masked, but sequence {seq.seq_id} still runs")
        if result.top_logprobs and len(result.top_logprobs) != num_ids:
            raise ValueError(f"{where}: {len(result.top_logprobs)} top logprobs for {num_ids} draws")
        self.num_passes_done += 1
        return draws

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens computed for prompts (and recomputation) rather than decodes."""
        if self.num_steps > 1:
            return 0
        return sum(r.num_tokens for r in self.rows if r.num_tokens > 1 or not r.samples)


@dataclasses.dataclass(slots=True)
class SeqUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when the request asked
    prompt: PromptTokens | None = None  # prompt_logprobs: with the sequence's first tokens
    embedding: list[float] = dataclasses.field(default_factory=list)  # a pooling sequence's vector
    # The detokenizer's first update of the sequence: its batch carries the sequence's DetokSeq.
    new_to_detokenizer: bool = False
