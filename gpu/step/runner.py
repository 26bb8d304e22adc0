"""ModelRunner: runs StepPlans on one device (one tensor-parallel rank), keeping step state there.

Owns the sequences the worker holds (`WorkerSeq`: tokens as the host knows them, computed count,
block table), their persistent batch, the KV caches plus one scratch block, the decode CUDA graphs
and the passes in flight (in_flight.py). What a step does beyond running the model is its
features' (gpu/step/features/: each a StepFeature whose hooks the core calls at fixed points), so
this file names none of them. Callers: `execute(plan)` runs a plan to its end (LLM, tests); the
worker stage iterates `launch(plan)` (a pass each) and sends what `collect(keep)` and
`collect_due()` return as the copies land (docs/architecture.md ("Overlap")).

Invariants:
- a plan that fails `check_plan` raises before any state changes; results come in launch
  order, one StepResult per pass of a plan with rows; a known seq_id is replaced (a resume);
- tensor parallelism: every rank runs every plan alike and rank 0 alone samples, so whatever
  changes which collectives a pass makes (rows left in a window, a void pass) is decided from
  state the ranks share: ids collected by count, never by a copy's readiness (timing differs
  between ranks), and features decide alike on every rank (features/base.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TypeVar

import torch

from conveyor.config.engine import EngineConfig
from conveyor.gpu.backends import Backend
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import shard_model_config
from conveyor.gpu.sampling.draws import DeviceSamples
from conveyor.gpu.step.advance import advance
from conveyor.gpu.step.cuda_graphs import DecodeGraphs, DecodeModel
from conveyor.gpu.step.features import StepFeature, features_for
from conveyor.gpu.step.features.base import Hooks
from conveyor.gpu.step.in_flight import InFlight
from conveyor.gpu.step.pass_clock import Mark, PassClock
from conveyor.gpu.step.pass_sampler import PassSampler
from conveyor.gpu.step.pass_work import PassBuilder
from conveyor.gpu.step.passes import LaunchedPass, PassOutput, PassWork, Window, WorkerSeq
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.plan_checks import check_plan
from conveyor.gpu.step.platform import Platform, platform_for
from conveyor.gpu.step.profile_steps import profile_run
from conveyor.gpu.step.step_inputs import PassInputs
from conveyor.wire.step import NewSeq, StepPlan, StepResult

log = logging.getLogger(__name__)
F = TypeVar("F", bound=StepFeature)


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
        self.in_flight = InFlight(config.model.eos_token_ids, self.tp.size)
        self._last_clock: PassClock | None = None
        # CUDA graphs of decode steps (gpu/step/cuda_graphs.py), captured once the pool exists; the
        # probe holds the largest one's memory while the pool is sized, so the pool leaves it.
        self.graphs: DecodeGraphs | None = None
        self._graph_probe: DecodeGraphs | None = None
        # What a step does beyond running the model (gpu/step/features/): each through StepFeature's hooks.
        self.features = features_for(config, self.platform, self.batch, self.tp, self.model, self.backend)
        self.hooks = hooks = Hooks(self.features)
        self.passes = PassBuilder(self.batch, self.attn, self.block_size, config.model.sliding_window, self._graphed, hooks)
        eos = config.model.eos_token_ids
        self.sampler = PassSampler(self.model, self.platform, self.batch, self.tp, eos, hooks, self.in_flight)

    def feature(self, kind: type[F]) -> F | None:
        """The runner's feature of class `kind`, if its config enables it."""
        return next((f for f in self.features if isinstance(f, kind)), None)

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
        per_block = self.attn.bytes_per_block(self.block_size) + sum(f.bytes_per_block() for f in self.features)
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
        for feature in self.features:
            feature.allocate(num_blocks + 1, self.kv_caches)
        self.num_blocks = num_blocks
        if self._uses_graphs():
            pool = self._graph_probe.pool if self._graph_probe is not None else None
            self.graphs = DecodeGraphs.from_config(
                self.config,
                self._decode_model(),
                self.attn,
                self.kv_caches,
                scratch_block=num_blocks,
                device=self.device,
                pool=pool,
                record=self.backend.ops.record if self.platform.records_programs else None,
            )
            self.graphs.capture_all()  # logs each bucket's time and memory
            self._graph_probe = None

    def _decode_model(self) -> DecodeModel:
        """The model as decode graphs capture and run it, each feature's wrapper around it."""
        model: DecodeModel = self.model
        for feature in self.features:
            model = feature.decode_model(model)
        return model

    def _uses_graphs(self) -> bool:
        """Whether decode steps take the decode-graph path (captured on CUDA, recorded by the cpu
        ops on a CPU). Not with tp > 1: a graph around collectives is possible but has not been run
        here, so those steps run eagerly."""
        eager = self.config.parallel.enforce_eager or any(f.runs_eagerly for f in self.features)
        graphs = self.platform.runs_graphs or (self.platform.records_programs and self.backend.ops.records)
        return graphs and not eager and self.attn.supports_decode_graphs and self.tp.size == 1

    # --- running plans ------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[StepResult]:
        """Run the plan to its end: its StepResults, one per pass (none without rows)."""
        results: list[StepResult] = []
        for _ in self.launch(plan):
            results += self.collect(keep=0)
        return results + self.collect(keep=0)

    def has_pending(self) -> bool:
        return bool(self.in_flight)

    def landing_in(self) -> float | None:
        return self.in_flight.landing_in()  # docstrings: gpu/step/in_flight.py

    def collect_due(self) -> list[StepResult]:
        return self.in_flight.collect_due()

    def collect(self, keep: int = 0) -> list[StepResult]:
        return self.in_flight.collect(keep)

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
        """Check the plan, then drop finished sequences, register new ones, apply the features'
        parts, copy blocks (copy-on-write) and rewrite, then extend, each row's block table; the
        plan's window."""
        check_plan(plan, self.seqs, self.config.model, self.num_blocks, self.block_size, self.max_blocks_per_seq)
        for seq_id in plan.finished_seq_ids:
            if self.seqs.pop(seq_id, None) is not None:
                self.batch.remove(seq_id)
                for drop in self.hooks.drop:
                    drop(seq_id)
        for new in plan.new_seqs:
            self._register(new)
        for apply in self.hooks.apply:
            apply(plan)
        self.attn.copy_blocks(self.kv_caches, plan.copy_blocks)
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

    def _register(self, new: NewSeq) -> None:
        # A known seq_id is a resume after preemption, computed again from 0 or from a prefix-cache
        # hit: then the leading num_computed_tokens already have KV in the row's blocks.
        seq = WorkerSeq(new.seq_id, list(new.token_ids), new.params, new.num_prompt_tokens, new.num_computed_tokens, index=new.index)
        self.seqs[new.seq_id] = seq
        for register in self.hooks.register:
            register(seq, new)
        self.batch.add(new.seq_id, [], new.params)

    def _adopt(self, fork: WorkerSeq) -> None:
        """A fork made by a pass (gpu/step/advance.py): the worker holds it from now on."""
        self.seqs[fork.seq_id] = fork
        for register in self.hooks.register:
            register(fork, None)

    # --- one pass: inputs, forward, sample, advance, report ----------------------------------

    def _launch_pass(self, window: Window, k: int, arrival: Mark | None) -> bool:
        """Launch pass k of the window; False when no row is left to run it."""
        active = list(range(len(window.rows))) if k == 0 else window.active(k)
        if self.in_flight.pending and self.passes.must_wait(window, active, k):
            self.in_flight.settle()  # the host needs every id in flight first
            active = active if k == 0 else window.active(k)
        if not active:
            return False
        clock = PassClock(self.platform.mark, arrival if arrival is not None else self._last_clock)
        work = self.passes.first(window) if k == 0 else self.passes.next(window, k, active)
        for begin_pass in self.hooks.begin_pass:
            begin_pass(work)
        hidden = self._forward(work.inputs)  # [T, H]
        outputs = [out for after in self.hooks.after_forward if (out := after(work, hidden, k == 0)) is not None]
        samples, param_slots = None, None
        if work.sampling:
            drawn = self.sampler.sample(work, hidden[work.inputs.logit_index], window, k)
            if drawn is None:  # every row stopped in the pass before: this one is void
                return False
            samples, param_slots = drawn
        draw_seqs = advance(work, samples, param_slots, self.batch, self._adopt)
        clock.stop()
        self._report(window, k, active, work, draw_seqs, samples, clock, outputs)
        return True

    def _report(
        self,
        window: Window,
        k: int,
        active: list[int],
        work: PassWork,
        draw_seqs: list[WorkerSeq],
        samples: DeviceSamples | None,
        clock: PassClock,
        outputs: list[PassOutput],
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
        drafts = {work.rows[i].seq_id: d for i, d in work.drafts.items()}
        self.in_flight.add(LaunchedPass(window, k, reported, computed, samples, copy, clock, drafts, outputs))
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
        extras = {"input_embeds": inputs.input_embeds, "rope_positions": inputs.rope_positions}
        if any(v is not None for v in extras.values()):  # a pass through images' rows, or M-RoPE
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, **extras)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def _graphed(self, num_rows: int, all_decode: bool) -> bool:
        return self.graphs is not None and all_decode and self.graphs.bucket_for(num_rows) is not None
