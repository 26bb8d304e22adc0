"""Scheduler: which sequences run in the next forward pass, and how many tokens of each.

Each step has one token budget (max_num_batched_tokens). Under the default policy, Dynamic
SplitFuse, running sequences come first (decodes, then prompts under way) and waiting sequences
are admitted in (priority, arrival) order into what is left, the last one's prompt split so the
budget is met exactly. Two baselines exist for the simulator: prefill_first (whole prompts in
steps of their own; vLLM before chunked prefill) and orca (decodes plus whole prompts).

Memory: a sequence reuses every cached full block of its known tokens at admission (never the
block of its last token, whose logits are needed); blocks are allocated as tokens are scheduled,
named in the prefix cache as they fill, and freed when the sequence ends. A write into a block
another sequence still holds first copies it (copy-on-write). The block manager keeps the block
tables; this class decides. When not one token of a running sequence fits, the running sequence
with the lowest priority and latest arrival is preempted by recomputation: its blocks are freed
and it waits again with every token it has.

Parallel samples: a request for k samples runs as one sequence until its prompt is computed; the
step that samples its first token forks k-1 siblings sharing all its blocks.

Token counts are committed when a step is planned (`schedule`); sampled ids arrive later
(`update`). A driver may plan step n+1 before step n's ids are back (asynchronous scheduling):
a sequence drawing in step n then decodes its pending token in step n+1, which the worker knows
by then. Such a lookahead step can compute one token past an EOS or a stop string; its draw is
dropped when it comes back. A sequence whose pending draws already reach max_tokens or the
model's length is not scheduled again.

Multi-step windows (num_scheduler_steps = K > 1, stages/scheduler/windows.py): a step that would
only decode, with nothing waiting, becomes up to K decode passes in one plan; a waiting request
gets a single step, so its time to first token does not wait for a window. A window's rows count
all their passes as computed and pending when planned; each pass's result arrives on its own
(`update(..., pass_index=k)`) and streams at once. A row the worker left out (it ended the
window early) is rolled back and planned again. Pure Python: no torch, no zmq.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.config import SchedulerConfig
from conveyor.stages.scheduler.block_manager import BlockManager, kv_slots
from conveyor.stages.scheduler.early_aborts import EarlyAborts
from conveyor.stages.scheduler.scheduled_step import Row, ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.sequence import SeqStatus, Sequence
from conveyor.stages.scheduler.waiting_queue import WaitingQueue
from conveyor.stages.scheduler.windows import extend_rows, may_extend
from conveyor.wire.messages import FinishReason, ScheduleRequest, TokenLogprob, TopLogprobs


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        seq_ids: range = range(0, 2**63),
    ):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.by_request: dict[str, list[Sequence]] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_aborts = 0  # requests aborted while the scheduler knew them
        # The ids this scheduler hands out, in order: with data parallelism engine e of n numbers
        # its sequences e, e + n, e + 2n, ... so an id names its engine (wire/topology.engine_of_seq).
        self._seq_ids = seq_ids
        self._next_seq_id = seq_ids.start
        self._finished_for_worker: list[int] = []
        self._unsampled_updates: list[SeqUpdate] = []  # finishes with no token: aborts, too big for the pool
        self._early_aborts = EarlyAborts()

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        seq_ids: range = range(0, 2**63),
    ) -> Scheduler:
        """A scheduler over a fresh pool of `num_blocks` KV blocks of `block_size` tokens, with
        prefix caching as `config` says, numbering its sequences from `seq_ids`."""
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
        return cls(config, blocks, max_model_len=max_model_len, eos_token_ids=eos_token_ids, seq_ids=seq_ids)

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, request: ScheduleRequest, detokenizer: int = 0) -> Sequence | None:
        """Queue a request as one sequence (it forks later for several samples). Raises
        QueueFull past the queue bounds; None when the request was already aborted."""
        self.waiting.check_room(len(request.prompt_token_ids), self.config)
        seq = Sequence.from_request(self._new_seq_id(), request, detokenizer)
        return seq if self.add(seq) else None

    def add(self, seq: Sequence) -> bool:
        if self._early_aborts.take(seq.request_id):
            return False
        if seq.seq_id >= self._next_seq_id:  # the next id of ours past it
            step = self._seq_ids.step
            self._next_seq_id = seq.seq_id + step - (seq.seq_id - self._seq_ids.start) % step
        self.by_request.setdefault(seq.request_id, []).append(seq)
        self.waiting.push(seq)
        return True

    def abort(self, request_id: str) -> None:
        seqs = self.by_request.get(request_id)
        if seqs is None:
            self._early_aborts.remember(request_id)
            return
        self._abort_seqs(seqs, report=True)
        self.running = [s for s in self.running if not s.is_finished]

    def drop_requests(self, owned_by: Callable[[Sequence], bool]) -> list[Sequence]:
        """Abort every request one of whose sequences `owned_by` selects (the ingress or the
        detokenizer process it streams through died), reporting nothing to a detokenizer; one
        sequence of each such request, to answer its ingress."""
        dropped = [seqs for seqs in self.by_request.values() if any(owned_by(s) for s in seqs)]
        for seqs in dropped:
            self._abort_seqs(seqs, report=False)
        self.running = [s for s in self.running if not s.is_finished]
        return [seqs[0] for seqs in dropped]

    def _abort_seqs(self, seqs: list[Sequence], *, report: bool) -> None:
        """One request's sequences end with ABORT (the caller then filters `running`)."""
        self.num_aborts += 1
        for seq in list(seqs):
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT, report=report)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_unsampled_updates(self) -> list[SeqUpdate]:
        updates, self._unsampled_updates = self._unsampled_updates, []
        return updates

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        rows: list[Row] = []
        copies: list[tuple[int, int]] = []
        scheduled: set[int] = set()
        preemptions_before = self.num_preemptions
        policy = self.config.policy
        max_passes = self.config.num_scheduler_steps
        may_window = max_passes > 1 and not self.waiting  # nothing to admit: admission is a no-op

        if policy == "prefill_first":
            budget = self._admit(budget, rows, chunk=False)
            if not rows:  # no prompt could start: a decode-only (or prompt-continuation) step
                budget = self._run_running(budget, rows, copies, scheduled)
        else:
            budget = self._run_running(budget, rows, copies, scheduled)
            # Admit only in a step that did not have to preempt: the pool is short, and the
            # victim would just bounce back in.
            if self.num_preemptions == preemptions_before:
                budget = self._admit(budget, rows, chunk=policy == "splitfuse")

        if not rows and not self._finished_for_worker:
            return None
        num_steps = 1
        # Still nothing waiting: no row preempted another (a victim waits, and gets a single step).
        if may_window and not self.waiting and may_extend(self.running, rows):
            num_steps = extend_rows(rows, self.blocks, max_passes, self.max_model_len)
        new_seqs, new_seqs_computed, num_sampled = [], [], 0
        register_full_blocks = self.blocks.register_full_blocks
        for row in rows:
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
            if row.samples:
                if seq.num_pending_forks:
                    row.forks = self._fork(seq)
                seq.num_pending_tokens += 1
                for child in row.forks:
                    child.num_pending_tokens += 1
                num_sampled += 1 + len(row.forks)
        finished, self._finished_for_worker = self._finished_for_worker, []
        self.num_steps += 1
        return ScheduledStep(
            step=self.num_steps,
            rows=rows,
            new_seqs=new_seqs,
            new_seqs_computed=new_seqs_computed,
            copy_blocks=copies,
            finished_seq_ids=finished,
            num_tokens=self.config.max_num_batched_tokens - budget,
            num_sampled=num_sampled,
            num_steps=num_steps,
        )

    def update(
        self,
        step: ScheduledStep,
        sampled_token_ids: list[int],
        sampled_logprobs: list[float] | None = None,
        top_logprobs: list[TopLogprobs] | None = None,
        failed_draws: list[int] | None = None,
        *,
        pass_index: int = 0,
        masked_draws: list[int] | None = None,
        last_pass: bool = True,
    ) -> list[SeqUpdate]:
        """Apply one pass's sampled ids: one per sampling row, then one per fork of that row (in
        a window's pass k, one per row with num_tokens > k). `top_logprobs` has one entry per draw
        of a sequence that asked for logprobs. A draw in `failed_draws` (indices into the ids: its
        logits were not finite) ends its sequence with FinishReason.ERROR and its blocks are
        freed; the others go on. A window's passes come in order; a draw in `masked_draws` (the
        worker skipped it: its sequence stopped earlier in the window) must be stale. On
        `last_pass` before the window's end, rows still running with passes left roll back."""
        draws = step.take_pass(pass_index, last_pass, len(sampled_token_ids), failed_draws, masked_draws)
        failed = set(failed_draws or ())
        updates, self._unsampled_updates = self._unsampled_updates, []
        logprobs = iter(sampled_logprobs) if sampled_logprobs else None
        tops = iter(top_logprobs or ())
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        register_full_blocks, block_size = self.blocks.register_full_blocks, self.blocks.block_size
        for draw, ((row, seq), token) in enumerate(zip(draws, sampled_token_ids)):
            logprob = next(logprobs) if logprobs is not None else 0.0
            top = next(tops) if seq.params.logprobs is not None else None
            if seq.status is not SeqStatus.RUNNING or seq.num_preemptions != row.epoch:
                continue  # aborted, finished or preempted while the step ran: dropped
            if draw in failed:  # its placeholder id is no token of the sequence
                self._finish(seq, FinishReason.ERROR, report=False)
                updates.append(self._introduced(SeqUpdate(seq, [], FinishReason.ERROR)))
                continue
            if last_pass and step.num_steps > 1 and row.num_tokens > pass_index + 1:
                # The worker ended the window before this row's last passes: their tokens were
                # neither computed nor drawn. The row keeps its blocks (the worker's table holds
                # them too) and is planned again from here. Rolled back before any registration.
                missing = row.num_tokens - pass_index - 1
                seq.num_computed_tokens -= missing
                seq.num_pending_tokens -= missing
            seq.token_ids.append(token)
            seq.num_pending_tokens -= 1
            seq.cumulative_logprob += logprob
            reason = seq.stop_reason(token, eos, max_model_len)
            if reason is not None:
                self._finish(seq, reason, report=False)
            elif seq.num_registered_blocks < seq.num_computed_tokens // block_size:  # spares most draws the call
                # Registration covers the known ids (min(computed, known)), so the newest id's KV
                # may still be unwritten: a later pass, or the next plan, computes it. Both run
                # before any plan that could hit the block, as the worker runs plans and passes in
                # order: a pass that is not last promises the next, which computes this row unless
                # its sequence stopped (then the scheduler finished it on that stop, first), and a
                # last pass rolled its row back above. So every registered block's KV is written
                # by a pass the worker really runs for this sequence.
                register_full_blocks(seq)
            update = SeqUpdate(seq, [token], reason)
            if not seq.known_by_detokenizer:
                self._introduced(update)
            if top is not None:
                update.logprobs = [TokenLogprob(logprob, top.token_ids, top.logprobs)]
            updates.append(update)
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return updates

    def finish_seqs(self, seq_ids: list[int]) -> None:
        """Stop sequences a detokenizer found a stop string in (it already told the client)."""
        wanted = set(seq_ids)
        for seq in self.running:
            if seq.seq_id in wanted:
                self._finish(seq, FinishReason.STOP, report=False)
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    # --- the two halves of a step ----------------------------------------------------------

    def _run_running(self, budget: int, rows: list[Row], copies: list, scheduled: set[int]) -> int:
        """Decodes first (one token each), then prompts under way, in admission order."""
        decodes: list[Sequence] = []
        prompts: list[Sequence] = []
        max_model_len = self.max_model_len
        for seq in self.running:
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.num_pending_tokens and seq.at_length_limit(seq.num_tokens, max_model_len):
                continue  # its pending draw is its last
            (decodes if seq.num_uncomputed_tokens == 1 else prompts).append(seq)
        can_append_in_place = self.blocks.can_append_in_place
        for seq in decodes:
            if budget == 0:
                return 0
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            # The common case first: room left in its own last block.
            row = Row(seq, 1, [], []) if can_append_in_place(seq) else self._reserve(seq, 1, scheduled, copies)
            if row is None:
                continue
            rows.append(row)
            scheduled.add(seq.seq_id)
            budget -= 1
        for seq in prompts:
            if budget == 0:
                return 0
            if seq.status is not SeqStatus.RUNNING:
                continue
            row = self._reserve(seq, min(seq.num_uncomputed_tokens, budget), scheduled, copies)
            if row is not None:
                rows.append(row)
                scheduled.add(seq.seq_id)
                budget -= row.num_tokens
        return budget

    def _admit(self, budget: int, rows: list[Row], *, chunk: bool) -> int:
        """Start waiting sequences while the budget, the seats and the pool allow."""
        blocks = self.blocks
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            hits = blocks.match_prefix(seq)
            num_uncached = seq.num_tokens - len(hits) * blocks.block_size
            num = min(num_uncached, budget)
            whole_prompt_fits = num == num_uncached
            if not chunk and not whole_prompt_fits and (rows or budget < self.config.max_num_batched_tokens):
                break  # no splitting: it waits for a step with room for all of it
            num = min(num, blocks.num_admittable(hits))
            if num < 1:
                if not self.running and not rows:  # the whole pool is free and still too small
                    self._finish(seq, FinishReason.LENGTH)
                    continue
                break
            self.waiting.pop()
            blocks.allocate_prompt(seq, hits, num)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            rows.append(Row(seq, num, [], []))
            budget -= num
        return budget

    # --- room, forks, endings -------------------------------------------------------------

    def _reserve(self, seq: Sequence, num: int, scheduled: set[int], copies: list) -> Row | None:
        """Blocks for up to `num` more tokens of a running sequence: a prompt chunk shrinks to
        what fits; when not one token fits, others are preempted. None: nothing reserved."""
        blocks = self.blocks
        while (fit := min(num, blocks.num_appendable(seq))) < 1:
            victim = max(
                (s for s in self.running if s.status is SeqStatus.RUNNING and s.seq_id not in scheduled),
                key=lambda s: s.sort_key,
                default=None,
            )
            if victim is None or victim is seq:
                if blocks.num_used == len(seq.block_ids):
                    # It holds the whole pool and still needs more: it can never finish. It
                    # leaves `running` now: the next plan may come before the next update().
                    self._finish(seq, FinishReason.LENGTH)
                    self.running.remove(seq)
                elif victim is seq:  # the least important itself: it yields
                    self._preempt(seq)
                return None
            self._preempt(victim)
        copy = blocks.append(seq, fit)
        if copy is None:
            return Row(seq, fit, [], [])
        copies.append((copy.src, copy.dst))
        return Row(seq, fit, [], [(copy.position, copy.dst)])

    def _fork(self, seq: Sequence) -> list[Sequence]:
        children = []
        for index in range(1, seq.num_pending_forks + 1):
            child = seq.fork(self._new_seq_id(), index)
            self.blocks.fork(seq, child)
            child.num_blocks_sent = len(child.block_ids)  # the worker copies the parent's table
            self.by_request[seq.request_id].append(child)
            self.running.append(child)
            children.append(child)
        seq.num_pending_forks = 0
        return children

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0  # in-flight draws come back to a waiting sequence: dropped
        seq.num_preemptions += 1
        if seq.known_by_worker:
            seq.known_by_worker = False
            self._finished_for_worker.append(seq.seq_id)
        self.running.remove(seq)
        self.waiting.push(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason, *, report: bool = True) -> None:
        """End a sequence and free its blocks; `report` queues the update for the detokenizer
        (update() reports the sequences that finish on a sampled token itself)."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending_tokens = 0  # draws still in flight are dropped when they come back
        self.blocks.release(seq)
        if seq.known_by_worker:
            self._finished_for_worker.append(seq.seq_id)
        if report:
            self._unsampled_updates.append(self._introduced(SeqUpdate(seq, [], reason)))
        seqs = self.by_request.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.by_request[seq.request_id]

    @staticmethod
    def _introduced(update: SeqUpdate) -> SeqUpdate:
        """The update, marked where it is its sequence's first: every update reaches the
        detokenizer, in the order they are made, and the first brings the sequence's DetokSeq."""
        seq = update.seq
        if not seq.known_by_detokenizer:
            seq.known_by_detokenizer = update.new_to_detokenizer = True
        return update

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += self._seq_ids.step
        return seq_id

    # --- accounting ----------------------------------------------------------------------

    def kv_slots(self) -> tuple[int, int]:
        """(allocated, filled) token slots of the running sequences' blocks (block_manager's
        kv_slots): 1 - filled/allocated is the KV memory wasted inside blocks."""
        return kv_slots(self.blocks, ((s.block_ids, s.num_computed_tokens) for s in self.running))
