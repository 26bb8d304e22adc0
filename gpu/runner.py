"""ModelRunner: runs one StepPlan on the device and returns the sampled token ids and logprobs.

It owns the model, the KV caches and the per-sequence state the plans refer to by seq_id (token
ids, how many have KV in the cache, block table, sampling params, choice index). Per plan: drop
finished sequences, register new ones (a known seq_id is replaced: a resume after preemption,
computed again from 0 or from its prefix-cache hit), copy the plan's KV blocks (copy-on-write),
rewrite then extend each row's block table, then every ScheduledSeq row computes its next
`num_tokens` tokens. A row whose computed count reaches its known tokens samples one more, which
is appended to the sequence, and one per fork from the same logits: each fork starts as a copy
of the sequence plus its own token. Sampling (penalties, filters, draws, logprobs) is
conveyor.gpu.sampling's; a draw whose logits were not finite appends a placeholder 0 and is
named in StepResult.failed_draws, and the scheduler ends its sequence.

Inputs are built on the host with one pass per sequence (never per token), then copied
non-blocking (from pinned memory on CUDA). The scheduler side sees only StepPlan / StepResult.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from conveyor.config.engine import EngineConfig
from conveyor.gpu.backends import AttentionMetadata, Backend, select
from conveyor.gpu.host_memory import keep_freed_memory
from conveyor.gpu.kv_cache import num_blocks_for_memory
from conveyor.gpu.loader import load_model
from conveyor.gpu.profile_steps import profile_steps
from conveyor.gpu.sampling import SamplingRow, StepSamples, sample_step
from conveyor.wire.messages import MAX_LOGPROBS, Fork, NewSeq, SamplingParams, ScheduledSeq, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerSeq:
    token_ids: list[int]  # prompt, then every output so far
    params: SamplingParams
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = dataclasses.field(default_factory=list)
    index: int = 0  # choice index within the request: seeded draws mix it in

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_index: torch.Tensor  # [S] int64: each sampling row's last token in the step
    sampling_rows: list[int]  # indices into the plan's rows of the S rows that sample


class ModelRunner:
    """`backend`: the attention backend and ops to run on; None (the worker): chosen from
    config.parallel.attention_backend by gpu.backends.select."""

    def __init__(self, config: EngineConfig, rank: int = 0, backend: Backend | None = None) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.device = _device(config.parallel.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse warm heap pages instead of fresh mmaps
        # The attention backend and ops, chosen once: auto is triton on CUDA, cpu (the C++ kernels)
        # on a CPU, torch where the cpu backend cannot run.
        self.backend = backend or select(config.parallel.attention_backend, self.device, config.model)
        log.info("attention backend: %s", self.backend.description)
        self.attn = self.backend.attn
        self.model = load_model(config.model, self.device, self.backend)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.seqs: dict[int, WorkerSeq] = {}
        self._last_return: float | None = None  # perf_counter when execute last returned

    def num_available_blocks(self) -> int:
        """KV blocks this device can hold next to the model (and, on CUDA, a full step's peak)."""
        if self.device.type == "cuda" and self.config.cache.num_kv_blocks is None:
            self._profile_run()
        return num_blocks_for_memory(self.attn.bytes_per_block(self.block_size), self.config.cache, self.device)

    def initialize_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.attn.allocate_kv_caches(num_blocks, self.block_size)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        entered = time.perf_counter()
        # The bubble: the step's wall time the device did not compute, from the end of the last
        # step (or the plan's arrival, after an idle spell) to the end of this one.
        idle_from = entered if plan.after_idle or self._last_return is None else self._last_return
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._register(new)
        self.attn.copy_blocks(self.kv_caches, plan.copy_blocks)

        samples = StepSamples([], [], [])
        busy = 0.0
        if plan.scheduled:
            rows = [self.seqs[row.seq_id] for row in plan.scheduled]
            _check_block_ids(plan.scheduled, self.num_blocks)
            for seq, row in zip(rows, plan.scheduled):
                _update_block_table(seq, row)
            num_tokens = [row.num_tokens for row in plan.scheduled]
            inputs = self._prepare(rows, num_tokens)
            forks = self._check_forks(plan.scheduled, inputs.sampling_rows)
            with DeviceTimer(self.device) as timer:
                samples = self._run(rows, inputs, forks)
            busy = timer.seconds
            # Advance the state only after the step succeeded.
            for seq, n in zip(rows, num_tokens):
                seq.num_computed += n
            self._append_sampled([rows[i] for i in inputs.sampling_rows], forks, samples.token_ids)
        self._last_return = time.perf_counter()
        return StepResult(
            step=plan.step,
            sampled_token_ids=samples.token_ids,
            busy_time=busy,
            idle_time=max(0.0, self._last_return - idle_from - busy),
            sampled_logprobs=samples.logprobs,
            top_logprobs=samples.top_logprobs,
            failed_draws=samples.failed_draws,
        )

    def _register(self, new: NewSeq) -> WorkerSeq:
        vocab = self.config.model.vocab_size
        if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < vocab:
            raise ValueError(f"seq {new.seq_id}: token id out of range [0, {vocab})")
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            raise ValueError(f"seq {new.seq_id}: {new.num_computed_tokens} cached of {len(new.token_ids)} tokens")
        if new.params.logit_bias and not all(0 <= t < vocab for t in new.params.logit_bias):
            raise ValueError(f"seq {new.seq_id}: logit_bias token id out of range [0, {vocab})")
        # A prefix-cache hit: the leading num_computed_tokens already have KV in the row's blocks.
        return WorkerSeq(list(new.token_ids), new.params, new.num_prompt_tokens, new.num_computed_tokens, index=new.index)

    def _check_forks(self, scheduled: list[ScheduledSeq], sampling_rows: list[int]) -> list[list[Fork]]:
        """The forks of each sampling row; raises if a non-sampling row forks or a fork's seq_id
        is taken."""
        sampling = set(sampling_rows)
        new_ids = [f.seq_id for i, row in enumerate(scheduled) for f in row.forks if i in sampling]
        if any(row.forks for i, row in enumerate(scheduled) if i not in sampling):
            raise ValueError("a row that does not sample cannot fork")
        if len(set(new_ids)) != len(new_ids) or any(i in self.seqs for i in new_ids):
            raise ValueError(f"fork seq_ids {new_ids} repeat or are already live")
        return [scheduled[i].forks for i in sampling_rows]

    def _append_sampled(self, sampling: list[WorkerSeq], forks: list[list[Fork]], sampled: list[int]) -> None:
        """Each sampling row's token, then one new sequence per fork: the row's state after the
        step (its own block table list) plus the fork's token. `sampled` is in draw order."""
        tokens = iter(sampled)
        for seq, row_forks in zip(sampling, forks, strict=True):
            own = next(tokens)
            for fork in row_forks:
                self.seqs[fork.seq_id] = dataclasses.replace(
                    seq, token_ids=[*seq.token_ids, next(tokens)], block_table=list(seq.block_table), index=fork.index
                )
            seq.token_ids.append(own)
        assert next(tokens, None) is None, "more sampled ids than draws"

    def _prepare(self, rows: list[WorkerSeq], num_tokens: list[int]) -> StepInputs:
        """Host lists -> device tensors, one pass per sequence."""
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logit_index: list[int] = []  # token index (in the step) of each sampling row's last token
        sampling_rows: list[int] = []
        max_len = self.config.model.max_model_len
        for i, (seq, n) in enumerate(zip(rows, num_tokens)):
            start, end = seq.num_computed, seq.num_computed + n
            if n < 1 or end > len(seq.token_ids) or end > max_len:
                raise ValueError(f"row computes tokens [{start}, {end}) of a {len(seq.token_ids)}-token sequence")
            if len(seq.block_table) * self.block_size < end:
                raise ValueError(f"block table of {len(seq.block_table)} blocks cannot hold {end} tokens")
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            seq_lens.append(end)
            if end == len(seq.token_ids):
                logit_index.append(len(input_ids) - 1)
                sampling_rows.append(i)

        # [B, max_blocks], padded with block 0 (attention masks the padding out).
        needed = [-(-end // self.block_size) for end in seq_lens]
        tables = np.zeros((len(rows), max(needed)), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(rows, needed)):
            tables[i, :n] = seq.block_table[:n]

        positions_t = self._to_device(torch.tensor(positions, dtype=torch.int64))
        meta = self.attn.build_metadata(
            num_tokens,
            seq_lens,
            self._to_device(torch.from_numpy(tables)),
            positions_t,
            self.block_size,
            self.config.model.sliding_window,
        )
        return StepInputs(
            input_ids=self._to_device(torch.tensor(input_ids, dtype=torch.int64)),
            positions=positions_t,
            meta=meta,
            logit_index=self._to_device(torch.tensor(logit_index, dtype=torch.int64)),
            sampling_rows=sampling_rows,
        )

    def _run(self, rows: list[WorkerSeq], inputs: StepInputs, forks: list[list[Fork]]) -> StepSamples:
        """Forward and sampling -> one token id and logprob per draw (each sampling row, then its
        forks in order), and top logprobs for the draws that asked."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)  # [T, H]
        if not inputs.sampling_rows:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return StepSamples([], [], [])
        logits = self.model.compute_logits(hidden[inputs.logit_index])  # [S, V] float32
        sampling = [
            SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, [seq.index, *(f.index for f in row_forks)])
            for seq, row_forks in zip((rows[i] for i in inputs.sampling_rows), forks, strict=True)
        ]  # fmt: skip
        return sample_step(logits, sampling, self.config.model.eos_token_ids)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The worst steps the scheduler can plan (gpu/profile_steps.py: a fresh prefill at the
        full token budget, the budget as decode rows at the longest context, a chunk after a long
        cached prefix), then sampling for the most rows, on a scratch cache, so the activations'
        peak is held by torch's allocator when memory is measured."""
        model_cfg, sched = self.config.model, self.config.scheduler
        steps = profile_steps(sched.max_num_batched_tokens, sched.max_num_seqs, model_cfg.max_model_len, self.block_size)
        # Every sampling feature at once, so that the peak covers their [S, V] temporaries.
        params = SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
            repetition_penalty=1.1, min_tokens=2, logit_bias={0: 1.0}, logprobs=MAX_LOGPROBS, max_tokens=None,
        )  # fmt: skip
        saved = self.kv_caches, self.num_blocks
        self.num_blocks = max(step.num_blocks for step in steps)
        self.kv_caches = self.attn.allocate_kv_caches(self.num_blocks, self.block_size)
        try:
            for step in steps:
                rows = [
                    WorkerSeq([0] * n, params, n, num_computed=n - q, block_table=list(table))
                    for q, n, table in zip(step.query_lens, step.seq_lens, step.block_tables)
                ]
                inputs = self._prepare(rows, step.query_lens)
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)  # [T, H]
                if step is steps[0]:  # the prefill: T is the whole budget, enough rows to sample
                    self._profile_sampling(hidden, params)
        finally:
            self.kv_caches, self.num_blocks = saved

    def _profile_sampling(self, hidden: torch.Tensor, params: SamplingParams) -> None:
        model_cfg, sched = self.config.model, self.config.scheduler
        num_rows = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        history = [0] * min(model_cfg.max_model_len, sched.max_num_batched_tokens)  # one output: min_tokens still bans EOS
        row = SamplingRow(params, history, len(history) - 1, [0])
        sample_step(logits, [row] * num_rows, model_cfg.eos_token_ids)


def _check_block_ids(scheduled: list[ScheduledSeq], num_blocks: int) -> None:
    """Every block a plan names must exist: the CPU kernel writes through block tables without
    bounds checks, so a bad id would corrupt memory instead of raising."""
    for row in scheduled:
        ids = [*row.new_block_ids, *(block for _, block in row.replaced_blocks)]
        if ids and not 0 <= min(ids) <= max(ids) < num_blocks:
            raise ValueError(f"seq {row.seq_id}: block ids {ids} outside the pool [0, {num_blocks})")


def _update_block_table(seq: WorkerSeq, row: ScheduledSeq) -> None:
    """Copy-on-write replacements first (their blocks were filled by the plan's copy_blocks),
    then the row's new blocks."""
    for pos, block in row.replaced_blocks:
        if not 0 <= pos < len(seq.block_table):
            raise ValueError(f"seq {row.seq_id}: replaced block position {pos} outside its {len(seq.block_table)}")
        seq.block_table[pos] = block
    seq.block_table.extend(row.new_block_ids)


class DeviceTimer:
    """Device compute time of a region: CUDA events around it on a GPU (the host clock would
    count launch overhead the device spends idle), the host clock on CPU. The region must end
    in a device sync, as a step does when it copies the sampled ids back."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1000
        else:
            self.seconds = time.perf_counter() - self._started


def _device(name: str, rank: int) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank)
    return device
