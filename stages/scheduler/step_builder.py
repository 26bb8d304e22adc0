"""StepBuilder: one step's rows, as the Scheduler picks them within its token budget.

`run_running` gives running sequences their rows (decodes first, one token each, then prompts
under way, in admission order); `admit` starts waiting sequences in the budget, the seats and the
pool left, each reusing its cached prefix (and what the KV tiers load for it, kv_tiers.py), in
queue order but past one set aside (its adapter has no slot, or its KV comes at the next step);
`reserve` finds blocks for a running sequence's next
tokens, shrinking a prompt chunk to what fits and, when not one token fits, preempting the least
important running sequence that has no row yet; `commit` counts the rows' tokens as computed and
their draws as pending, and makes the ScheduledStep. The Scheduler owns the sequences and how they
end (`preempt`, `finish`); forks.py makes a row's siblings; a builder lives for one `Scheduler.schedule` call.
Pure Python.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from conveyor.stages.scheduler.forks import fork_siblings
from conveyor.stages.scheduler.scheduled_step import Row, ScheduledStep
from conveyor.stages.scheduler.sequence import SeqStatus, Sequence
from conveyor.stages.scheduler.speculation import grant_lookahead, reserve_ahead, speculates
from conveyor.wire.messages import FinishReason
from conveyor.wire.step import LoraLoad
from conveyor.wire.stop_rules import tokens_left

if TYPE_CHECKING:
    from conveyor.stages.scheduler.scheduler import Scheduler


class StepBuilder:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.budget = sched.config.max_num_batched_tokens  # tokens the step may still compute
        self.rows: list[Row] = []
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies before the forward: copy-on-write
        self.scheduled: set[int] = set()  # seq ids with a row: never preempted for another row
        self.lora_loads: list[LoraLoad] = []  # adapters the admitted sequences need placed first

    @property
    def num_tokens(self) -> int:
        return self.sched.config.max_num_batched_tokens - self.budget

    def run_running(self) -> None:
        """Decodes first (one token each, then the lookahead of those that verify drafts), then
        prompts under way, in admission order."""
        decodes: list[Sequence] = []
        prompts: list[Sequence] = []
        sched = self.sched
        max_model_len = sched.max_model_len
        for seq in sched.running:
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.num_pending_tokens:  # its pending draws, and the drafts the worker may hold (speculation.py), may be its last
                num_ahead = seq.num_tokens + seq.num_pending_lookahead
                if tokens_left(seq.params, num_ahead, seq.num_prompt_tokens, max_model_len) <= 0:
                    continue
            (decodes if seq.num_uncomputed_tokens == 1 else prompts).append(seq)
        can_append_in_place = sched.blocks.can_append_in_place
        for seq in decodes:
            if self.budget == 0:
                return
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            if seq.num_pending_lookahead:  # the worker may be ahead: slots for that too, or it waits
                row = reserve_ahead(seq, sched.blocks)
            else:  # the common case first: room left in its own last block
                row = Row(seq, 1, [], []) if can_append_in_place(seq) else self.reserve(seq, 1)
            if row is not None:
                self.add(row)
        spec = sched.speculative
        if spec is not None and speculates(spec, len(sched.running)):
            for row in self.rows:
                if self.budget == 0:
                    return
                self.budget -= grant_lookahead(row, spec, sched.blocks, self.budget, max_model_len)
        for seq in prompts:
            if self.budget == 0:
                return
            if seq.status is not SeqStatus.RUNNING:
                continue
            row = self.reserve(seq, min(seq.num_uncomputed_tokens, self.budget))
            if row is not None:
                self.add(row)

    def admit(self, *, chunk: bool) -> None:
        """Start waiting sequences while the budget, the seats and the pool allow; without
        `chunk`, a prompt that does not fit whole waits for a step with room for all of it."""
        sched = self.sched
        set_aside: list[Sequence] = []  # their adapter found no slot, or their prefix comes from disk: the next ones may go first
        try:
            self._admit(chunk, set_aside)
        finally:
            for seq in set_aside:
                sched.waiting.push(seq)

    def _admit(self, chunk: bool, set_aside: list[Sequence]) -> None:
        sched = self.sched
        blocks, config, adapters = sched.blocks, sched.config, sched.adapters
        while self.budget > 0 and len(sched.running) < config.max_num_seqs:
            seq = sched.waiting.peek()
            if seq is None:
                break
            if sched.tiers is not None and sched.tiers.reading(seq):  # its prefix is on its way from disk
                set_aside.append(sched.waiting.pop())
                continue
            adapter = seq.params.adapter
            if adapter is not None and adapters is not None and seq.lora_slot < 0 and not self._place(seq, adapter):
                set_aside.append(sched.waiting.pop())
                continue
            tiers = sched.tiers
            swapped = tiers.resume(seq, idle=not sched.running and not self.rows) if tiers is not None else None
            if swapped is not None:  # preempted by swapping (kv_tiers.py)
                if swapped and tiers is not None and tiers.loading_back(seq):  # it runs at the next plan
                    set_aside.append(sched.waiting.pop())
                    continue
                if swapped or not self._resume(seq):
                    break  # its blocks have no room yet
                continue
            hits = blocks.match_prefix(seq)
            if tiers is not None:  # its prefix may go on in the host tier, or on disk
                prefix = tiers.prefetch(seq, hits, sched.num_steps + 1, functools.partial(self._starts, seq, chunk=chunk))
                if prefix is None:  # its blocks come from disk, or back for the next plan: the ones behind it go first
                    set_aside.append(sched.waiting.pop())
                    continue
                hits = prefix  # with any blocks this plan loads for it: their copy comes before the pass
            num_uncached = seq.num_tokens - len(hits) * blocks.block_size
            num = min(num_uncached, self.budget)
            if not self._starts(seq, len(hits), chunk=chunk):
                break
            num = min(num, blocks.num_admittable(hits))
            if num < 1 and tiers is not None and tiers.release_holds():  # prefixes held for waiting sequences yield
                num = min(num_uncached, self.budget, blocks.num_admittable(hits))
            if seq.images:
                num = seq.num_chunk_tokens(seq.num_tokens - num_uncached, num)
            if num < 1:
                if not sched.running and not self.rows and not (tiers is not None and tiers.held_blocks()):
                    sched.finish(seq, FinishReason.LENGTH)  # the whole pool is free and still too small
                    continue
                break
            sched.waiting.pop()
            blocks.allocate_prompt(seq, hits, num)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            sched.running.append(seq)
            self.rows.append(Row(seq, num, [], []))
            self.budget -= num

    def _starts(self, seq: Sequence, num_prefix_blocks: int, *, chunk: bool) -> bool:
        """Whether the budget left lets a waiting sequence start after a prefix of that many
        blocks: without `chunk`, a prompt that does not fit whole starts only in a step of its own."""
        num_uncached = seq.num_tokens - num_prefix_blocks * self.sched.blocks.block_size
        return chunk or num_uncached <= self.budget or (not self.rows and self.budget == self.sched.config.max_num_batched_tokens)

    def _resume(self, seq: Sequence) -> bool:
        """Run a swapped-out sequence again from its restored table: its next chunk, as a running
        sequence's (it holds its blocks alone). False: no token fits this step."""
        num = min(seq.num_tokens - seq.num_computed_tokens, self.budget, self.sched.blocks.num_appendable(seq))
        if seq.images:
            num = seq.num_chunk_tokens(seq.num_computed_tokens, num)
        if num < 1:
            assert self.sched.tiers is not None
            self.sched.tiers.hold_again(seq)
            return False
        self.sched.waiting.pop()
        self.sched.blocks.append(seq, num)
        seq.status = SeqStatus.RUNNING
        self.sched.running.append(seq)
        self.add(Row(seq, num, [], []))
        return True

    def _place(self, seq: Sequence, adapter: str) -> bool:
        """Give a waiting sequence its adapter's slot (pinned until it stops running: Scheduler.stop_running);
        False when every slot is pinned by other adapters."""
        assert self.sched.adapters is not None
        placed = self.sched.adapters.acquire(adapter)
        if placed is None:
            return False
        seq.lora_slot, load = placed
        if load is not None:
            self.lora_loads.append(load)
        return True

    def reserve(self, seq: Sequence, num: int) -> Row | None:
        """Blocks for up to `num` more tokens of a running sequence: a prompt chunk shrinks to
        what fits; when not one token fits, others are preempted. None: nothing reserved."""
        sched = self.sched
        blocks = sched.blocks
        while (fit := min(num, blocks.num_appendable(seq))) < 1:
            tiers = sched.tiers  # blocks held for waiting sequences yield first: prefixes, then swapped-out blocks loaded back
            if tiers is not None and (tiers.release_holds() or tiers.release_loaded_back()):
                continue
            victim = max(
                (s for s in sched.running if s.status is SeqStatus.RUNNING and s.seq_id not in self.scheduled),
                key=lambda s: s.sort_key,
                default=None,
            )
            if victim is None or victim is seq:
                if blocks.num_used == len(seq.block_ids):
                    # It holds the whole pool and still needs more: it can never finish. It
                    # leaves `running` now: the next plan may come before the next update().
                    sched.finish(seq, FinishReason.LENGTH)
                    sched.running.remove(seq)
                elif victim is seq:  # the least important itself: it yields
                    sched.preempt(seq)
                return None
            sched.preempt(victim)
        if seq.images and (fit := seq.num_chunk_tokens(seq.num_computed_tokens, fit)) < 1:
            return None  # the image it would cut waits for a step with room for all of it
        copy = blocks.append(seq, fit)
        if copy is None:
            return Row(seq, fit, [], [])
        self.copies.append((copy.src, copy.dst))
        return Row(seq, fit, [], [(copy.position, copy.dst)])

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.scheduled.add(row.seq.seq_id)
        self.budget -= row.num_tokens

    def commit(self, step: int, num_steps: int, finished_seq_ids: list[int]) -> ScheduledStep:
        """Step number `step` of `num_steps` passes (> 1: a window, windows.py), its token counts
        committed: each row's tokens count as computed now and its draws as pending (the ids come
        with the result); a row reaching its sequence's last known token draws one, and one for
        each sibling it forks then; a window row draws once per pass."""
        sched = self.sched
        new_seqs, new_seqs_computed, num_sampled = [], [], 0
        register_full_blocks = sched.blocks.register_full_blocks
        for row in self.rows:
            seq = row.seq
            if not seq.known_by_worker:
                seq.known_by_worker = True
                seq.num_blocks_sent = 0
                new_seqs.append(seq)
                new_seqs_computed.append(seq.num_computed_tokens)
            row.new_block_ids = seq.block_ids[seq.num_blocks_sent :]
            seq.num_blocks_sent = len(seq.block_ids)
            seq.num_computed_tokens += row.num_tokens
            register_full_blocks(seq)
            row.epoch = seq.num_preemptions
            if num_steps > 1:  # a window row: one draw per pass, its tokens pending like any draw
                row.samples = True
                seq.num_pending_tokens += row.num_tokens
                num_sampled += row.num_tokens
                continue
            row.samples = seq.num_computed_tokens == seq.num_tokens
            seq.num_pending_lookahead += row.lookahead
            if row.samples:
                if seq.num_pending_forks:
                    row.forks = fork_siblings(sched, seq)
                seq.num_pending_tokens += 1
                for child in row.forks:
                    child.num_pending_tokens += 1
                num_sampled += 1 + len(row.forks)
        return ScheduledStep(
            step=step,
            rows=self.rows,
            new_seqs=new_seqs,
            new_seqs_computed=new_seqs_computed,
            copy_blocks=self.copies,
            finished_seq_ids=finished_seq_ids,
            num_tokens=self.num_tokens,
            num_sampled=num_sampled,
            num_steps=num_steps,
            lora_loads=self.lora_loads,
            kv_saves=tiers.saves if (tiers := sched.tiers) is not None else [],
            kv_loads=tiers.loads if tiers is not None else [],
            kv_fetches=tiers.fetches if tiers is not None else [],
        )
