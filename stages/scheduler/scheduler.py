"""Scheduler: which sequences run in the next forward pass, and how many tokens of each.

Each step has one token budget (max_num_batched_tokens). Running sequences come first, decodes
before unfinished prompts, then waiting sequences are admitted first come first served; a prompt
longer than what is left of the budget is split across steps (chunked prefill). KV blocks are
allocated as tokens are scheduled and freed when a sequence ends. When blocks run out, the most
recently admitted running sequence is preempted by recomputation: its blocks are freed and it goes
back to the front of the waiting queue with every token it has, to be recomputed later.

The step's token counts are committed when the step is planned (`schedule`); the sampled tokens
arrive later (`update`). Pure Python: no torch, no zmq.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.block_pool import BlockPool
from conveyor.stages.scheduler.sequence import Sequence, SeqStatus
from conveyor.wire.messages import FinishReason

EARLY_ABORT_TTL_S = 60.0  # an abort may overtake its request (they come from different stages)


@dataclasses.dataclass
class ScheduledStep:
    step: int
    rows: list[tuple[Sequence, int]]  # (sequence, tokens computed this step), in plan order
    samples: list[bool]  # per row: the chunk reaches the last known token, so a token is sampled
    new_seqs: list[Sequence]  # sequences the worker sees for the first time (or after preemption)
    new_block_ids: list[list[int]]  # per row: blocks to append to the worker's block table
    finished_seq_ids: list[int]  # sequences the worker may forget
    num_tokens: int


@dataclasses.dataclass
class SeqUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finish_reason: FinishReason | None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockPool,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_request: dict[str, list[Sequence]] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self._finished_for_worker: list[int] = []
        self._aborted_updates: list[SeqUpdate] = []
        self._early_aborts: dict[str, float] = {}

    # --- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if self._early_aborts.pop(seq.request_id, None) is not None:
            return
        self.by_request.setdefault(seq.request_id, []).append(seq)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        seqs = self.by_request.get(request_id)
        if seqs is None:
            now = time.monotonic()
            self._early_aborts = {r: t for r, t in self._early_aborts.items() if now - t < EARLY_ABORT_TTL_S}
            self._early_aborts[request_id] = now
            return
        for seq in seqs:
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                self._aborted_updates.append(SeqUpdate(seq, [], FinishReason.ABORT))
        self.running = [s for s in self.running if not s.is_finished]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        rows: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        preemptions_before = self.num_preemptions

        # Decodes first (one token each), then prompts already under way, in admission order.
        for phase_decode in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.is_finished or seq.seq_id in scheduled or seq.status is not SeqStatus.RUNNING:
                    continue
                if (seq.num_uncomputed_tokens == 1) != phase_decode:
                    continue
                num = self._reserve(seq, min(seq.num_uncomputed_tokens, budget), scheduled)
                if num == 0:
                    continue
                rows.append((seq, num))
                scheduled.add(seq.seq_id)
                budget -= num

        # Then admit waiting sequences while the budget, the seat count and the pool allow (not
        # in a step that had to preempt: the pool is short, and the victim would just bounce).
        preempted = self.num_preemptions != preemptions_before
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num = self._fit(seq, min(seq.num_uncomputed_tokens, budget))
            if num < 1:
                break
            needed = self.blocks.blocks_needed(seq.num_computed_tokens + num, len(seq.block_ids))
            self.waiting.popleft()
            seq.block_ids += self.blocks.allocate(needed)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            rows.append((seq, num))
            scheduled.add(seq.seq_id)
            budget -= num

        if not rows and not self._finished_for_worker:
            return None
        new_seqs, new_block_ids, samples = [], [], []
        for seq, num in rows:
            if not seq.known_by_worker:
                seq.known_by_worker = True
                seq.num_blocks_sent = 0
                new_seqs.append(seq)
            new_block_ids.append(seq.block_ids[seq.num_blocks_sent :])
            seq.num_blocks_sent = len(seq.block_ids)
            seq.num_computed_tokens += num
            samples.append(seq.num_computed_tokens == seq.num_tokens)
        finished, self._finished_for_worker = self._finished_for_worker, []
        self.num_steps += 1
        return ScheduledStep(
            step=self.num_steps,
            rows=rows,
            samples=samples,
            new_seqs=new_seqs,
            new_block_ids=new_block_ids,
            finished_seq_ids=finished,
            num_tokens=self.config.max_num_batched_tokens - budget,
        )

    def update(self, step: ScheduledStep, sampled_token_ids: list[int]) -> list[SeqUpdate]:
        """Apply a step's sampled tokens (one per row that reached its last known token)."""
        updates, self._aborted_updates = self._aborted_updates, []
        sampled = iter(sampled_token_ids)
        for (seq, _), samples in zip(step.rows, step.samples):
            if not samples:
                continue  # a prompt chunk short of the end
            token = next(sampled)
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran: the token is dropped
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            updates.append(SeqUpdate(seq, [token], reason))
        self.running = [s for s in self.running if not s.is_finished]
        return updates

    def take_aborted_updates(self) -> list[SeqUpdate]:
        updates, self._aborted_updates = self._aborted_updates, []
        return updates

    # --- helpers -------------------------------------------------------------------------

    def _fit(self, seq: Sequence, num: int) -> int:
        """How many of `num` more tokens fit in the sequence's blocks plus the free ones."""
        capacity = (len(seq.block_ids) + self.blocks.num_free) * self.blocks.block_size
        return min(num, capacity - seq.num_computed_tokens)

    def _reserve(self, seq: Sequence, num: int, scheduled: set[int]) -> int:
        """Blocks for up to `num` more tokens of a running sequence: a prompt chunk shrinks to
        what fits; when not one token fits, later arrivals are preempted. Returns tokens reserved."""
        while (fit := self._fit(seq, num)) < 1:
            victim = next(
                (s for s in reversed(self.running) if s.seq_id not in scheduled and not s.is_finished),
                None,
            )
            if victim is None or victim is seq:
                if self.blocks.num_used == len(seq.block_ids):
                    # It holds the whole pool and still needs more: it can never finish.
                    self._finish(seq, FinishReason.LENGTH)
                    self._aborted_updates.append(SeqUpdate(seq, [], FinishReason.LENGTH))
                elif victim is seq:
                    self._preempt(seq)
                return 0
            self._preempt(victim)
        needed = self.blocks.blocks_needed(seq.num_computed_tokens + fit, len(seq.block_ids))
        seq.block_ids += self.blocks.allocate(needed)
        return fit

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        if seq.known_by_worker:
            seq.known_by_worker = False
            self._finished_for_worker.append(seq.seq_id)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        if seq.known_by_worker:
            self._finished_for_worker.append(seq.seq_id)
        seqs = self.by_request.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.by_request[seq.request_id]

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
