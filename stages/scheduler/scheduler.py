"""Scheduler: which sequences run in the next forward pass, and how many tokens of each.

`schedule` spends one token budget (max_num_batched_tokens) per step. Under Dynamic SplitFuse,
running sequences come first (decodes, then prompts under way), then waiting ones in (priority,
arrival) order, the last prompt split so the budget is met exactly; prefill_first and orca are
the simulator's baselines. `update` applies a pass's sampled ids. docs/architecture.md
("Scheduler") walks through admission, the prefix cache, preemption, forks and windows.

Invariants: token counts are committed when a step is planned and ids arrive later, so draws may
be pending (a step ahead under asynchronous scheduling, a window's passes under multi-step); a
draw that comes back to a sequence finished or preempted since is dropped; a prefix-cache hit
never covers a sequence's last known token; a block another sequence holds is copied before it
is written; when not one token of a running sequence fits, the least important running sequence
is preempted by recomputation. Pure Python: no torch, no zmq.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.config import SchedulerConfig
from conveyor.config.speculative import SpeculativeConfig
from conveyor.stages.scheduler.adapters import Adapters, UnknownAdapter
from conveyor.stages.scheduler.block_manager import BlockManager, kv_slots
from conveyor.stages.scheduler.early_aborts import EarlyAborts
from conveyor.stages.scheduler.kv_tiers import KvTiers
from conveyor.stages.scheduler.prompt_outputs import attach_prompt_outputs, take_prompt_outputs
from conveyor.stages.scheduler.scheduled_step import ScheduledStep, SeqUpdate
from conveyor.stages.scheduler.sequence import SeqStatus, Sequence
from conveyor.stages.scheduler.speculation import settle_lookahead
from conveyor.stages.scheduler.step_builder import StepBuilder
from conveyor.stages.scheduler.waiting_queue import WaitingQueue
from conveyor.stages.scheduler.windows import extend_rows, may_extend, roll_back_unrun
from conveyor.wire.messages import FinishReason, ScheduleRequest, TokenLogprob
from conveyor.wire.step import StepResult


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        seq_ids: range = range(0, 2**63),
        speculative: SpeculativeConfig | None = None,
        adapters: Adapters | None = None,
        tiers: KvTiers | None = None,
    ):
        self.config = config
        self.tiers = tiers  # the KV tiers beyond the device pool (kv_tiers.py); None: the device's alone
        self.adapters = adapters  # LoRA (adapters.py); None: the base weights only
        self.speculative = speculative  # speculation.py: which rows get lookahead
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
        speculative: SpeculativeConfig | None = None,
        adapters: Adapters | None = None,
        num_host_slots: int = 0,
        kv_warm: list[tuple[int, int]] | None = None,
        num_disk_blocks: int = 0,
        kv_disk: list[int] | None = None,
        num_ranks: int = 1,
    ) -> Scheduler:
        """A scheduler over a fresh pool of `num_blocks` KV blocks of `block_size` tokens, with
        prefix caching as `config` says, numbering its sequences from `seq_ids`, its decoding
        rows verifying drafts as `speculative` says (None: never), its prefix cache going on into
        `num_host_slots` blocks of host memory (0: none), `kv_warm` the (name, slot) blocks they
        hold from the start, and on into `num_disk_blocks` blocks on disk (0: none), `kv_disk`
        the names there from the start, each read by `num_ranks` workers."""
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
        tiers = KvTiers(blocks, num_host_slots, kv_warm or (), num_disk_blocks, kv_disk or (), num_ranks) if num_host_slots else None
        return cls(
            config,
            blocks,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            seq_ids=seq_ids,
            speculative=speculative,
            adapters=adapters,
            tiers=tiers,
        )

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, request: ScheduleRequest, detokenizer: int = 0) -> Sequence | None:
        """Queue a request as one sequence (it forks later for several samples). Raises
        QueueFull past the queue bounds, UnknownAdapter for an adapter it does not serve; None
        when the request was already aborted."""
        adapter = request.params.adapter
        if adapter is not None:
            if self.adapters is None:
                raise UnknownAdapter(adapter)
            self.adapters.check(adapter)
        self.waiting.check_room(len(request.prompt_token_ids), self.config)
        seq = Sequence.from_request(self.new_seq_id(), request, detokenizer)
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
                self.finish(seq, FinishReason.ABORT, report=report)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.tiers is not None and self.tiers.holding))

    def take_unsampled_updates(self) -> list[SeqUpdate]:
        updates, self._unsampled_updates = self._unsampled_updates, []
        return updates

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """The next step (None: nothing to run or tell the worker), its token counts committed."""
        if self.tiers is not None:
            self.tiers.begin_step(self.num_steps + 1)
        build = StepBuilder(self)
        preemptions_before = self.num_preemptions
        policy = self.config.policy
        max_passes = self.config.num_scheduler_steps
        may_window = max_passes > 1 and not self.waiting  # nothing to admit: admission is a no-op
        if policy == "prefill_first":
            build.admit(chunk=False)
            if not build.rows:  # no prompt could start: a decode-only (or prompt-continuation) step
                build.run_running()
        else:
            build.run_running()
            # Admit only in a step that did not have to preempt: the pool is short, and the
            # victim would just bounce back in.
            if self.num_preemptions == preemptions_before:
                build.admit(chunk=policy == "splitfuse")
        rows = build.rows
        moves = self.tiers is not None and (self.tiers.saves or self.tiers.loads or self.tiers.fetches)
        if not rows and not self._finished_for_worker and not build.lora_loads and not moves:
            return None
        num_steps = 1
        # Still nothing waiting: no row preempted another (a victim waits, and gets a single step).
        if may_window and not self.waiting and may_extend(self.running, rows):
            num_steps = extend_rows(rows, self.blocks, max_passes, self.max_model_len)
        finished, self._finished_for_worker = self._finished_for_worker, []
        self.num_steps += 1
        return build.commit(self.num_steps, num_steps, finished)

    def update(self, step: ScheduledStep, result: StepResult) -> list[SeqUpdate]:
        """Apply one pass's result: ScheduledStep.take_pass checks it and finds each draw's row by
        its sequence id; what the prompts computed beside the draws waits on their sequences
        (prompt_outputs.py); each draw of a sequence still running settles its row's lookahead
        (speculation.py), rolls its row back where the worker ended a window early (windows.py)
        and joins the sequence, which may stop on it. A failed draw (its logits were not finite)
        ends its sequence with FinishReason.ERROR and frees its blocks; the others go on."""
        draws = step.take_pass(result)
        updates, self._unsampled_updates = self._unsampled_updates, []
        take_prompt_outputs(step, result)
        failed = set(result.failed_draws)
        window_ended = result.last_pass and step.num_steps > 1
        logprobs, tops = result.sampled_logprobs, result.top_logprobs
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        register_full_blocks, block_size = self.blocks.register_full_blocks, self.blocks.block_size
        previous = None  # the sequence of the draw before: a run's later draws are accepted drafts
        for draw, ((row, seq), token) in enumerate(zip(draws, result.sampled_token_ids)):
            in_run, previous = seq is previous, seq
            if seq.status is not SeqStatus.RUNNING or seq.num_preemptions != row.epoch:
                continue  # aborted, finished or preempted while the step ran: dropped
            if in_run or row.lookahead:  # (a call per draw only where there is something to settle)
                settle_lookahead(row, seq, in_run)
            if draw in failed:  # its placeholder id is no token of the sequence
                self.finish(seq, FinishReason.ERROR, report=False)
                updates.append(self._introduced(SeqUpdate(seq, [], FinishReason.ERROR)))
                continue
            if window_ended:
                roll_back_unrun(step, result, row, seq)
            logprob = logprobs[draw] if logprobs else 0.0
            reason = seq.take_draw(token, logprob, eos, max_model_len)
            if reason is not None:
                self.finish(seq, reason, report=False)
            elif seq.num_registered_blocks < seq.num_computed_tokens // block_size:  # spares most draws the call
                # The newest id's KV may be unwritten yet, but the pass that writes it runs before
                # any plan that could hit the block (block_manager.register_full_blocks says why).
                register_full_blocks(seq)
            if not in_run:  # else the run's tokens go out as one update
                updates.append(self._introduced(SeqUpdate(seq, [], None)))
                if seq.prompt_logprobs is not None or seq.embedding:
                    attach_prompt_outputs(updates[-1])
            update = updates[-1]
            update.new_token_ids.append(token)
            update.finish_reason = reason
            if tops and seq.params.logprobs is not None:
                top = tops[draw]
                update.logprobs.append(TokenLogprob(logprob, top.token_ids, top.logprobs))
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return updates

    def finish_seqs(self, seq_ids: list[int]) -> None:
        """Stop sequences a detokenizer found a stop string in (it already told the client)."""
        wanted = set(seq_ids)
        for seq in self.running:
            if seq.seq_id in wanted:
                self.finish(seq, FinishReason.STOP, report=False)
        self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]

    # --- endings ---------------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Free its blocks; it waits again with every token it has, to be computed again, or, with
        --preemption-mode swap and room in the host tier, to have its blocks loaded back."""
        if self.config.preemption_mode == "swap" and self.tiers is not None:
            self.tiers.swap_out(seq)  # before the release: it copies the table's blocks
        self.blocks.release(seq)
        self._leave_slot(seq)
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0  # in-flight draws come back to a waiting sequence: dropped
        seq.num_pending_lookahead = 0
        seq.num_preemptions += 1
        if seq.known_by_worker:
            seq.known_by_worker = False
            self._finished_for_worker.append(seq.seq_id)
        self.running.remove(seq)
        self.waiting.push(seq)
        self.num_preemptions += 1

    def _leave_slot(self, seq: Sequence) -> None:
        """Unpin its adapter's slot (it may be taken once no running sequence holds it)."""
        if seq.lora_slot >= 0 and self.adapters is not None and seq.params.adapter is not None:
            self.adapters.release(seq.params.adapter)
        seq.lora_slot = -1

    def finish(self, seq: Sequence, reason: FinishReason, *, report: bool = True) -> None:
        """End a sequence and free its blocks; `report` queues the update for the detokenizer
        (update() reports the sequences that finish on a sampled token itself)."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending_tokens = 0  # draws still in flight are dropped when they come back
        seq.num_pending_lookahead = 0
        self.blocks.release(seq)
        self._leave_slot(seq)
        if self.tiers is not None:
            self.tiers.forget(seq)
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

    def new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += self._seq_ids.step
        return seq_id

    # --- accounting ----------------------------------------------------------------------

    def kv_slots(self) -> tuple[int, int]:
        """(allocated, filled) token slots of the running sequences' blocks (block_manager's
        kv_slots): 1 - filled/allocated is the KV memory wasted inside blocks."""
        return kv_slots(self.blocks, ((s.block_ids, s.num_computed_tokens) for s in self.running))
