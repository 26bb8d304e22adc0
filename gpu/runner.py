"""ModelRunner: runs one StepPlan on the device and returns the sampled token ids.

It owns the model, the KV caches and the per-sequence state the plans refer to by seq_id (token
ids, how many have KV in the cache, block table, sampling params). Per plan: drop finished
sequences, register new ones (a known seq_id is replaced: a resume after preemption, computed
again from 0), then every ScheduledSeq row computes its next `num_tokens` tokens; a row whose
computed count reaches its known tokens samples one more, which is appended to the sequence.

Inputs are built on the host with one pass per sequence (never per token), then copied
non-blocking (from pinned memory on CUDA). The scheduler side sees only StepPlan / StepResult.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from conveyor.config.engine import EngineConfig
from conveyor.gpu.attention import AttentionMetadata
from conveyor.gpu.kv_cache import allocate_kv_caches, num_blocks_for_memory
from conveyor.gpu.loader import load_model
from conveyor.gpu.sampler import sample
from conveyor.wire.messages import NewSeq, SamplingParams, StepPlan, StepResult


@dataclasses.dataclass
class SeqState:
    token_ids: list[int]  # prompt, then every output so far
    params: SamplingParams
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = dataclasses.field(default_factory=list)

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
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.block_size = config.cache.block_size
        self.device = _device(config.parallel.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = load_model(config.model, self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.seqs: dict[int, SeqState] = {}
        self._last_return: float | None = None  # perf_counter when execute last returned

    def num_available_blocks(self) -> int:
        """KV blocks this device can hold next to the model (and, on CUDA, a full step's peak)."""
        if self.device.type == "cuda" and self.config.cache.num_kv_blocks is None:
            self._profile_run()
        return num_blocks_for_memory(self.config.model, self.config.cache, self.device)

    def initialize_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.config.model, num_blocks, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        entered = time.perf_counter()
        idle = 0.0 if self._last_return is None else entered - self._last_return
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._register(new)

        sampled: list[int] = []
        busy = 0.0
        if plan.scheduled:
            rows = [self.seqs[row.seq_id] for row in plan.scheduled]
            for seq, row in zip(rows, plan.scheduled):
                seq.block_table.extend(row.new_block_ids)
            num_tokens = [row.num_tokens for row in plan.scheduled]
            inputs = self._prepare(rows, num_tokens)
            started = time.perf_counter()
            sampled = self._run(rows, inputs)
            busy = time.perf_counter() - started  # _run ends in a device sync (tolist / synchronize)
            # Advance the state only after the step succeeded.
            for seq, n in zip(rows, num_tokens):
                seq.num_computed += n
            for i, token in zip(inputs.sampling_rows, sampled, strict=True):
                rows[i].token_ids.append(token)
        self._last_return = time.perf_counter()
        return StepResult(step=plan.step, sampled_token_ids=sampled, busy_time=busy, idle_time=idle)

    def _register(self, new: NewSeq) -> SeqState:
        vocab = self.config.model.vocab_size
        if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < vocab:
            raise ValueError(f"seq {new.seq_id}: token id out of range [0, {vocab})")
        return SeqState(list(new.token_ids), new.params, new.num_prompt_tokens)

    def _prepare(self, rows: list[SeqState], num_tokens: list[int]) -> StepInputs:
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
        meta = AttentionMetadata.build(
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

    def _run(self, rows: list[SeqState], inputs: StepInputs) -> list[int]:
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)  # [T, H]
        if not inputs.sampling_rows:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return []
        logits = self.model.compute_logits(hidden[inputs.logit_index])  # [S, V] float32
        sampling = [rows[i] for i in inputs.sampling_rows]
        params = [seq.params for seq in sampling]
        output_indices = [seq.num_output_tokens for seq in sampling]
        return sample(logits, params, output_indices).tolist()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward at the full token budget plus sampling for the most rows, on a scratch
        cache, so the activations' peak is held by torch's allocator when memory is measured."""
        model_cfg, sched = self.config.model, self.config.scheduler
        total = sched.max_num_batched_tokens
        lens = [min(model_cfg.max_model_len, total - i) for i in range(0, total, model_cfg.max_model_len)]
        num_blocks = sum(-(-n // self.block_size) for n in lens)
        caches = allocate_kv_caches(model_cfg, num_blocks, self.block_size, self.device)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        rows, next_block = [], 0
        for n in lens:
            blocks = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(blocks)
            rows.append(SeqState([0] * n, params, n, block_table=blocks))
        saved, self.kv_caches = self.kv_caches, caches
        try:
            inputs = self._prepare(rows, lens)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
            num_rows = min(sched.max_num_seqs, total)
            logits = self.model.compute_logits(hidden[:num_rows])
            sample(logits, [params] * num_rows, [0] * num_rows)
            torch.cuda.synchronize(self.device)
        finally:
            self.kv_caches = saved


def _device(name: str, rank: int) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank)
    return device
