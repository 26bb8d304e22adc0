"""ModelRunner: runs StepPlans on one device (one tensor-parallel rank), keeping step state there.

Owns the sequences the worker holds (`WorkerSeq`: tokens as the host knows them, computed count,
block table, matcher), their persistent batch, the KV caches plus one scratch block, the decode
CUDA graphs and the passes launched but not yet collected. Callers: `execute(plan)` runs a plan
to its end (LLM, tests); the worker stage iterates `launch(plan)` (a pass each) and sends what
`collect(keep)` and `collect_due()` return as the copies land (docs/architecture.md ("Overlap")).

Invariants:
- a plan that fails `check_plan` raises before any state changes; results come in launch
  order, one StepResult per pass of a plan with rows; a known seq_id is replaced (a resume);
- tensor parallelism: every rank runs every plan alike and rank 0 alone samples, so whatever
  changes which collectives a pass makes (rows left in a window, a void pass) is decided from
  state the ranks share: ids collected by count, never by a copy's readiness (timing differs
  between ranks), and whether a row is constrained, never its matcher (only rank 0 has one).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterator

import torch

from conveyor.config.engine import EngineConfig
from conveyor.gpu.backends import Backend
from conveyor.gpu.lora.slots import LoraSlots
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.sampling import share_draws
from conveyor.gpu.parallel.shard import shard_model_config
from conveyor.gpu.sampling import SamplingRow
from conveyor.gpu.sampling.draws import DeviceSamples, argmax_draws, only_argmax
from conveyor.gpu.sampling.penalties import penalises_repeats
from conveyor.gpu.sampling.prompt_logprobs import PromptLogprobsOnDevice, compute_prompt_logprobs, prompt_rows
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.spec.speculator import Speculator
from conveyor.gpu.step.cuda_graphs import DecodeGraphs
from conveyor.gpu.step.pass_clock import Mark, PassClock
from conveyor.gpu.step.passes import LaunchedPass, PassWork, Window, WorkerSeq, pass_result
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.plan_checks import check_plan
from conveyor.gpu.step.platform import Platform, platform_for
from conveyor.gpu.step.pooling import PooledOnDevice, Pooler
from conveyor.gpu.step.profile_steps import profile_run
from conveyor.gpu.step.step_inputs import PassInputs, RowSpec, first_pass_inputs, next_pass_inputs
from conveyor.gpu.structured import Matcher, TokenMask, grammars_for, token_mask
from conveyor.wire.messages import NewSeq, StepPlan, StepResult

log = logging.getLogger(__name__)


class ModelRunner:
    """`backend`: the attention backend and ops to run on; None (the worker): chosen from
    config.parallel.attention_backend by gpu.backends.select. `tp`: the tensor-parallel group
    this runner is rank tp.rank of (gpu/parallel/rendezvous.py; None: one rank). `device_index`:
    on CUDA, the visible device it takes (gpu/step/platform.py `platform_for`; the worker passes its
    process index). What it runs on, a real device or an emulated one, is its `platform`'s."""

    def __init__(
        self, config: EngineConfig, device_index: int = 0, backend: Backend | None = None, tp: TensorParallel | None = None
    ) -> None:
        self.config = config
        self.tp = tp or SINGLE
        self.block_size = config.cache.block_size
        self.platform: Platform = platform_for(config, device_index, self.tp.size)
        self.device = self.platform.device
        # The attention backend and ops, chosen once: auto is triton on CUDA, cpu (the C++ kernels)
        # on a CPU, torch where the cpu backend cannot run.
        # Its KV layout is the rank's: its share of the KV heads (or one replica of one), in the
        # cache's dtype (--kv-cache-dtype).
        model_shard = shard_model_config(config.model, self.tp.size)
        kv_dtype = config.cache.kv_dtype(config.model.dtype)
        backend = backend or self.platform.backend(config.parallel.attention_backend, model_shard, kv_dtype)
        self.backend = dataclasses.replace(backend, tp=self.tp)
        log.info("attention backend: %s", self.backend.description)
        self.attn = self.backend.attn
        self.model = self.platform.load_model(config.model, self.backend)
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0  # the scheduler's pool: ids [0, num_blocks); one more block is scratch
        self.batch = PersistentBatch(config.scheduler.max_num_seqs, self.max_blocks_per_seq, self.device)
        self.seqs: dict[int, WorkerSeq] = {}
        self._constrained: set[int] = set()  # the seq_ids of seqs whose params.structured is set
        self._pending: collections.deque[LaunchedPass] = collections.deque()  # launched, not collected
        self._collected: list[StepResult] = []  # finished early (a pass had to wait for them)
        self._last_clock: PassClock | None = None
        # CUDA graphs of decode steps (gpu/step/cuda_graphs.py), captured once the pool exists; the
        # probe holds the largest one's memory while the pool is sized, so the pool leaves it.
        self.graphs: DecodeGraphs | None = None
        self._graph_probe: DecodeGraphs | None = None
        # Speculative decoding (gpu/spec/): the drafts of rows the plan grants a lookahead, and a
        # draft model's or EAGLE-3 head's KV beside the target's.
        self.spec = Speculator(config, self.platform, self.batch, self.tp, self.model) if config.speculative is not None else None
        self.pooler = Pooler(config.model.pooling) if config.model.pooling is not None else None
        # LoRA (gpu/lora/slots.py): --max-loras slots beside the weights, allocated before the KV pool is sized.
        self.lora = LoraSlots(self.model, config, self.backend.ops, self.tp, self.device) if config.lora.enable_lora else None
        if self.lora is not None:
            lora = config.lora
            size = self.lora.bytes / 2**20
            log.info("LoRA: %d slots at rank %d hold %.1f MiB beside the weights", lora.max_loras, lora.max_lora_rank, size)

    def num_available_blocks(self) -> int:
        """KV blocks this device can hold next to the model (and, on CUDA, a full step's peak),
        less the scratch block (a fixed --num-kv-blocks is the pool itself: the scratch block
        comes on top)."""
        if self._uses_graphs() and self.device.type == "cuda":
            self._graph_probe = DecodeGraphs.memory_probe(self.config, self._decode_model(), self.attn, self.device)
            seconds, graph_bytes = self._graph_probe.capture_all()
            log.info("CUDA graphs: the largest bucket takes %.1f MiB (probe captured in %.2f s)", graph_bytes / 2**20, seconds)
        if self.device.type == "cuda" and self.config.cache.num_kv_blocks is None:
            profile_run(self)
        per_block = self.attn.bytes_per_block(self.block_size) + (self.spec.bytes_per_block() if self.spec else 0)
        num_blocks = self.platform.kv_blocks(per_block, self.config.cache)
        num_blocks = num_blocks if self.config.cache.num_kv_blocks is not None else max(1, num_blocks - 1)
        size = f"{num_blocks} blocks of {self.block_size} tokens = {num_blocks * self.block_size} tokens"
        log.info(
            "KV cache: %s, %s (%.1f KiB a block, all layers)", size, str(self.attn.kv_dtype).removeprefix("torch."), per_block / 1024
        )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        """The pool the scheduler allocates from, plus one scratch block (id num_blocks) that
        no sequence owns: padded rows of a captured batch write their KV there."""
        self.kv_caches = self.attn.allocate_kv_caches(num_blocks + 1, self.block_size)
        if self.spec is not None:
            self.spec.allocate(num_blocks + 1)
        self.num_blocks = num_blocks
        if self._uses_graphs():
            pool = self._graph_probe.pool if self._graph_probe is not None else None
            self.graphs = DecodeGraphs.from_config(
                self.config, self._decode_model(), self.attn, self.kv_caches, scratch_block=num_blocks, device=self.device, pool=pool
            )
            self.graphs.capture_all()  # logs each bucket's time and memory
            self._graph_probe = None

    def _decode_model(self):
        """The model as decode graphs run it: with LoRA, its projections read the graphs' static slots."""
        return self.lora.graph_model(self.model) if self.lora is not None else self.model

    def _uses_graphs(self) -> bool:
        """Whether decode steps take the CUDA-graph path (captured on CUDA). Not with tp > 1: a graph
        around NCCL collectives is possible but has not been run here, so those steps run eagerly."""
        parallel = self.config.parallel
        eager = parallel.enforce_eager or (self.spec is not None and self.spec.runs_eagerly)
        return self.platform.runs_graphs and not eager and self.attn.supports_cuda_graphs and self.tp.size == 1

    # --- running plans ------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[StepResult]:
        """Run the plan to its end: its StepResults, one per pass (none without rows)."""
        results: list[StepResult] = []
        for _ in self.launch(plan):
            results += self.collect(keep=0)
        return results + self.collect(keep=0)

    def has_pending(self) -> bool:
        return bool(self._pending or self._collected)

    def landing_in(self) -> float | None:
        """Seconds until the oldest pass in flight has its ids on the host: 0.0 when it has (or
        results wait to be collected, or nothing is in flight); None where the device cannot say
        (a CUDA event can only be asked whether it completed)."""
        if self._collected or not self._pending or self._pending[0].copy is None:
            return 0.0
        return self._pending[0].copy.seconds_left()

    def collect_due(self) -> list[StepResult]:
        """What the worker collects when no plan came while it waited for `landing_in`: the
        oldest pass in flight, waited for, and every later one that already landed; where the
        device could not say when it lands (and one rank may decide alone), only what landed."""
        if self.tp.size == 1 and self.landing_in() is None:
            return self.collect(keep=len(self._pending))
        return self.collect(keep=max(0, len(self._pending) - 1))

    def collect(self, keep: int = 0) -> list[StepResult]:
        """Results of launched passes, in launch order: every pass whose ids already reached the
        host, then, waiting, older ones until at most `keep` passes remain in flight."""
        results, self._collected = self._collected, []
        with torch.inference_mode():
            while self._pending and (len(self._pending) > keep or self._landed(self._pending[0])):
                results.append(self._finish(self._pending.popleft()))
        return results

    def _landed(self, launched: LaunchedPass) -> bool:
        """Whether a pass's ids are on the host; with several ranks only a pass without draws
        counts (ranks must collect alike, and readiness is timing)."""
        return launched.copy is None or (self.tp.size == 1 and launched.copy.ready())

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Iterator[None]:
        """Apply the plan's diffs, then launch its passes, one per iteration. A bad plan raises
        before anything changed."""
        arrival = self.platform.mark() if plan.after_idle or self._last_clock is None else None
        window = self._apply(plan)
        if window is None:
            return
        for k in range(window.num_passes):
            if not self._launch_pass(window, k, arrival if k == 0 else None):
                return
            yield

    def _apply(self, plan: StepPlan) -> Window | None:
        """Check the plan, then drop finished sequences, register new ones, copy blocks (copy-on-write)
        and rewrite, then extend, each row's block table; the plan's window."""
        check_plan(plan, self.seqs, self.config.model, self.num_blocks, self.block_size, self.max_blocks_per_seq)
        for seq_id in plan.finished_seq_ids:
            if self.seqs.pop(seq_id, None) is not None:
                self.batch.remove(seq_id)
                self._constrained.discard(seq_id)
                if self.pooler is not None:
                    self.pooler.drop(seq_id)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._register(new)
            if new.params.structured is not None:
                self._constrained.add(new.seq_id)
            self.batch.add(new.seq_id, [], new.params)
        if self.lora is not None:
            for load in plan.lora_loads:
                self.lora.load(load)
        self.attn.copy_blocks(self.kv_caches, plan.copy_blocks)
        if self.spec is not None:
            self.spec.copy_blocks(plan.copy_blocks)
        if not plan.scheduled:
            return None
        rows = [self.seqs[row.seq_id] for row in plan.scheduled]
        for seq, row in zip(rows, plan.scheduled):
            for pos, block in row.replaced_blocks:
                seq.block_table[pos] = block
                self.batch.set_blocks(row.seq_id, pos, [block])
            if row.new_block_ids:  # most decode steps add none: the row stays clean, nothing to copy up
                self.batch.set_blocks(row.seq_id, len(seq.block_table), row.new_block_ids)
                seq.block_table.extend(row.new_block_ids)
        self.batch.sync()
        if plan.num_steps == 1:
            return Window(plan, rows, [1] * len(rows), 1)
        passes = [row.num_tokens for row in plan.scheduled]
        return Window(plan, rows, passes, max(passes))

    def _register(self, new: NewSeq) -> WorkerSeq:
        # A known seq_id is a resume after preemption, computed again from 0 or from a prefix-cache
        # hit: then the leading num_computed_tokens already have KV in the row's blocks.
        seq = WorkerSeq(new.seq_id, list(new.token_ids), new.params, new.num_prompt_tokens, new.num_computed_tokens, index=new.index)
        seq.lora_slot = new.lora_slot
        seq.matcher = self._matcher(seq)  # a resumed sequence's outputs replayed into it
        return seq

    def _matcher(self, seq: WorkerSeq) -> Matcher | None:
        """A fresh matcher for a constrained sequence, fed the outputs the host has seen (on the
        rank that samples: the others never mask)."""
        if seq.params.structured is None or not self.tp.samples:
            return None
        return grammars_for(self.config.model).matcher(seq.params.structured, seq.token_ids[seq.num_prompt_tokens :])

    # --- one pass: inputs, forward, sample, advance, report ----------------------------------

    def _launch_pass(self, window: Window, k: int, arrival: Mark | None) -> bool:
        """Launch pass k of the window; False when no row is left to run it."""
        active = list(range(len(window.rows))) if k == 0 else window.active(k)
        if self._must_wait(window, active, k):
            self._collected = self.collect(keep=0)  # the host needs every id in flight first (kept for the caller)
            active = active if k == 0 else window.active(k)
        if not active:
            return False
        clock = PassClock(self.platform.mark, arrival if arrival is not None else self._last_clock)
        work = self._first_pass(window) if k == 0 else self._next_pass(window, k, active)
        if self.lora is not None:
            self.lora.begin_pass([seq.lora_slot for seq in work.rows], work.num_new, graphed=work.inputs.meta is None)
        hidden = self._forward(work.inputs)  # [T, H]
        if self.spec is not None:
            self.spec.follow(work.inputs, work.rows)
        prompt = self._prompt_logprobs(work, hidden) if k == 0 else None
        pooled = self._pool(work, hidden) if k == 0 and self.pooler is not None else None
        samples, param_slots = None, None
        if work.sampling:
            drawn = self._sample(work, hidden[work.inputs.logit_index], window, k)
            if drawn is None:  # every row stopped in the pass before: this one is void
                return False
            samples, param_slots = drawn
        draw_seqs = self._advance(work, samples, param_slots)
        clock.stop()
        drafts = {work.rows[i].seq_id: d for i, d in work.drafts.items()}
        self._report(window, k, active, draw_seqs, samples, clock, drafts, prompt, pooled)
        return True

    def _pool(self, work: PassWork, hidden: torch.Tensor) -> PooledOnDevice | None:
        """The vectors of the pass's pooling rows whose prompt it finished (counts before _advance)."""
        assert self.pooler is not None
        rows = [(seq.seq_id, seq.num_computed, n, seq.num_prompt_tokens, seq.params) for seq, n in zip(work.rows, work.num_new)]
        return self.pooler.pool(rows, hidden)

    def _prompt_logprobs(self, work: PassWork, hidden: torch.Tensor) -> PromptLogprobsOnDevice | None:
        """The prompt logprobs of the pass's rows that ask for them (counts before _advance)."""
        rows = work.rows
        if not any(seq.params.prompt_logprobs is not None for seq in rows):
            return None
        specs = [
            (seq.seq_id, seq.num_computed, n, seq.num_prompt_tokens, seq.token_ids, seq.params.prompt_logprobs)
            for seq, n in zip(rows, work.num_new)
        ]
        wanted = prompt_rows(specs)
        return compute_prompt_logprobs(wanted, hidden, self.model.compute_logits) if wanted else None

    def _first_pass(self, window: Window) -> PassWork:
        """A plan's first pass: each row computes its chunk (a window's rows one token) and the
        rows reaching their known tokens draw, a forking row once more per fork."""
        plan, rows = window.plan, window.rows
        specs, num_new, sampling = [], [], []
        slots, one_step = self.batch.slots, plan.num_steps == 1
        drafts = self.spec.drafts(rows, plan.scheduled) if self.spec is not None and one_step else {}
        for i, (seq, row) in enumerate(zip(rows, plan.scheduled)):
            n = row.num_tokens if one_step else 1  # a window's first pass decodes
            end = seq.num_computed + n
            known, extra = seq.token_ids, len(drafts.get(i, ()))
            if extra:  # it computes its token and its drafts, and draws at each
                known = seq.token_ids + drafts[i]
                seq.verifying = True
            specs.append(RowSpec(slots[seq.seq_id], seq.num_computed, end + extra, known, end == seq.num_tokens, 1 + extra))
            num_new.append(n + extra)
            if end == seq.num_tokens:
                sampling.append(i)
        graphed = self._graphed(len(specs), max(num_new) == 1)
        inputs = first_pass_inputs(specs, self.batch, self.attn, self.block_size, self.config.model.sliding_window, not graphed)
        window.first = inputs
        return PassWork(inputs, rows, num_new, sampling, [plan.scheduled[i].forks for i in sampling], drafts)

    def _next_pass(self, window: Window, k: int, active: list[int]) -> PassWork:
        """Pass k > 0 of a window: every active row decodes one token and draws; none forks."""
        assert window.first is not None
        rows = [window.rows[i] for i in active]
        everyone = len(active) == len(window.rows)
        rows_left, eager = None if everyone else active, not self._graphed(len(active), True)
        inputs = next_pass_inputs(
            window.first, k, rows_left, self.batch, self.attn, self.block_size, self.config.model.sliding_window, eager
        )
        return PassWork(inputs, rows, [1] * len(rows), list(range(len(rows))), [[] for _ in rows])

    def _sample(self, work: PassWork, hidden: torch.Tensor, window: Window, k: int) -> tuple[DeviceSamples, torch.Tensor] | None:
        """hidden [S, H] of the sampling rows -> (the pass's draws, on every rank; each draw's
        parameters' slot [D], a fork drawing with its parent's). None: the pass turned void
        while its grammar masks waited for the ids in flight."""
        drawing = [work.rows[i] for i in work.sampling]
        greedy: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, valid) [S], no logits: draws wanting only an argmax
        if not any(work.forks) and all(only_argmax(seq.params, seq.num_output_tokens) for seq in drawing):
            greedy = self.model.compute_greedy(hidden)
        # [S, V] in the model dtype (other ranks: [S, 0]): the sampler upcasts only what its math needs
        logits = self.model.compute_logits(hidden, upcast=False) if greedy is None else None
        mask: TokenMask | None = None
        if self._constrained and any(seq.params.structured is not None for seq in drawing):
            # One mask row per logits row: a verifying row's position j masked as if its first j drafts were drawn.
            logit_rows: list[tuple[WorkerSeq, list[int]]] = []
            for i, seq in zip(work.sampling, drawing):
                drafts = work.drafts.get(i, [])
                logit_rows += [(seq, drafts[:j]) for j in range(len(drafts) + 1)]
            mask = self._grammar_mask(logit_rows)  # the host works while the device computes
            if k > 0 and not window.active(k):
                return None
        sampling_rows, param_slots = [], []
        for i, seq, forks in zip(work.sampling, drawing, work.forks):
            choices = [seq.index, *(f.index for f in forks)] if forks else [seq.index]
            sampling_rows.append(SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, choices, seq.num_output_tokens))
            param_slots += [self.batch.slots[seq.seq_id]] * len(choices)
            drafts = work.drafts.get(i, [])
            if drafts:  # position j draws output n + j as if drafts[:j] were drawn (verify.py)
                reads = penalises_repeats(seq.params)
                for j in range(1, len(drafts) + 1):
                    history = seq.token_ids + drafts[:j] if reads else seq.token_ids
                    sampling_rows.append(SamplingRow(seq.params, history, seq.num_prompt_tokens, choices, seq.num_output_tokens + j))
                param_slots += [self.batch.slots[seq.seq_id]] * len(drafts)
        param_slots_t = to_device(param_slots, torch.int64, self.device)
        drawn = None
        if greedy is not None:
            drawn = argmax_draws(*greedy, sampling_rows)
        elif self.tp.samples:
            assert logits is not None
            draw_params = self.batch.params.gather(param_slots_t)
            drawn = self.platform.draw(logits, sampling_rows, self.config.model.eos_token_ids, draw_params, mask)
        return share_draws(self.tp, drawn, sampling_rows, self.device), param_slots_t  # rank 0's ids on every rank

    def _advance(self, work: PassWork, samples: DeviceSamples | None, param_slots: torch.Tensor | None) -> list[WorkerSeq]:
        """The host's counts after the pass, each fork a copy of its parent plus its own draw,
        and the draws fed back into the batch as the rows' next inputs; the sequence of each
        draw, in draw order."""
        rows = work.rows
        for i, (seq, n) in enumerate(zip(rows, work.num_new)):
            seq.num_computed += n - len(work.drafts.get(i, ()))  # a verifying row: its token alone until collected
        for i in work.sampling:
            rows[i].num_tokens += 1
        if samples is None:
            return []
        assert param_slots is not None
        if not any(work.forks) and not work.drafts:  # each draw is its own row's: the slots are the parameters'
            self.batch.feed_back(param_slots, samples.token_ids)
            return [rows[i] for i in work.sampling]
        # A verifying row draws once per draft and once more; none of those is fed back (the
        # host gives its next input, once it knows which draws held: _must_wait).
        draw_seqs: list[WorkerSeq] = []
        draw_slots, fed = [], []  # each fed-back draw's slot, and its index among the draws
        for i, forks in zip(work.sampling, work.forks):
            seq = rows[i]
            extra = len(work.drafts.get(i, ()))
            if not extra:
                fed.append(len(draw_seqs))
                draw_slots.append(self.batch.slots[seq.seq_id])
            draw_seqs += [seq] * (1 + extra)
            for fork in forks:  # a copy of the sequence after this pass, with its own draw
                child = dataclasses.replace(seq, seq_id=fork.seq_id, index=fork.index, stopped=False)
                child.token_ids, child.block_table = list(seq.token_ids), list(seq.block_table)
                child.matcher = self._matcher(child)  # its own, where the parent's was for this draw
                self.seqs[fork.seq_id] = child
                if child.params.structured is not None:
                    self._constrained.add(fork.seq_id)
                fed.append(len(draw_seqs))
                draw_seqs.append(child)
                draw_slots.append(self.batch.fork(seq.seq_id, fork.seq_id))
        if fed:
            ids = samples.token_ids if len(fed) == len(draw_seqs) else samples.token_ids[to_device(fed, torch.int64, self.device)]
            self.batch.feed_back(to_device(draw_slots, torch.int64, self.device), ids)
        return draw_seqs

    def _report(
        self,
        window: Window,
        k: int,
        active: list[int],
        draw_seqs: list[WorkerSeq],
        samples: DeviceSamples | None,
        clock: PassClock,
        drafts: dict[int, list[int]],
        prompt: PromptLogprobsOnDevice | None = None,
        pooled: PooledOnDevice | None = None,
    ) -> None:
        """Queue the pass for collection, its ids copying to the host. The draws its result
        reports: the first pass's are the ones it drew; pass k's every row with more than k
        passes, in plan order, a row left out (its sequence stopped) masked."""
        if k == 0:
            reported, computed = draw_seqs, list[int | None](range(len(draw_seqs)))
        else:
            position = {row: c for c, row in enumerate(active)}
            taking_part = [i for i, n in enumerate(window.passes) if n > k]
            reported, computed = [window.rows[i] for i in taking_part], [position.get(i) for i in taking_part]
        copy = self.platform.host_copy(samples.tensors()) if samples is not None else None
        self._pending.append(LaunchedPass(window, k, reported, computed, samples, copy, clock, drafts, prompt, pooled))
        window.num_launched = k + 1
        self._last_clock = clock

    def _forward(self, inputs: PassInputs) -> torch.Tensor:
        """The model over a pass: a captured graph's replay when every row decodes and a bucket
        holds them (its output stays valid until the next replay: the logits are computed from
        it before then), else eagerly."""
        if inputs.meta is None:
            assert self.graphs is not None
            seq_lens = (inputs.positions + 1).to(torch.int32)  # [B]: each row's context, its new token included
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.block_tables, seq_lens)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def _graphed(self, num_rows: int, all_decode: bool) -> bool:
        return self.graphs is not None and all_decode and self.graphs.bucket_for(num_rows) is not None

    def _must_wait(self, window: Window, active: list[int], k: int) -> bool:
        """Whether the host must see the ids in flight before launching: a row whose penalties
        read its history, a forking row, or a row whose inputs it lacks beyond the newest."""
        if not self._pending:
            return False
        for i in active:
            seq = window.rows[i]
            lag = seq.num_tokens - len(seq.token_ids)
            if lag == 0:
                continue
            if penalises_repeats(seq.params) or seq.verifying:  # (verifying: its counts wait for its result)
                return True
            if k == 0 and window.plan.scheduled[i].num_lookahead:  # drafts are proposed from every id
                return True
            if k == 0:
                row = window.plan.scheduled[i]
                end = seq.num_computed + (1 if window.plan.num_steps > 1 else row.num_tokens)
                if row.forks or max(seq.num_computed, len(seq.token_ids)) < end - 1:
                    return True
        return False

    def _grammar_mask(self, rows: list[tuple[WorkerSeq, list[int]]]) -> TokenMask | None:
        """The mask of a pass whose sampling rows are `rows` (one logits row each), called once
        its forward is launched: the constrained rows' ids in flight are collected first (their
        matchers must have taken every earlier draw), then their matchers fill the bitmask. A row
        whose sequence stopped meanwhile draws unmasked: that draw is dropped anyway. Every rank
        waits alike (what it collects decides its next passes); only the sampling rank masks."""
        if self._pending and any(s.params.structured is not None and s.num_tokens > len(s.token_ids) for s, _ in rows):
            self._collected = self.collect(keep=0)  # kept for the caller, as in _launch_pass
        if not self.tp.samples:
            return None
        matchers = [None if seq.stopped or seq.matcher is None else (seq.matcher, drafts) for seq, drafts in rows]
        return token_mask(matchers, self.config.model.vocab_size, self.device)

    def _finish(self, launched: LaunchedPass) -> StepResult:
        return pass_result(launched, self.config.model.eos_token_ids)
