"""The KV sizing profile (CUDA): the worst steps the scheduler can plan, not only a fresh
prefill, run before the pool is sized.

`profile_run` runs each of these on a scratch cache so that torch's allocator holds the largest
activation peak any step will need; the pool then gets what is left. Three shapes, each at the
full token budget:
- fresh prefill: prompts of max_model_len tokens (the last one shorter) filling the budget;
- decode: min(max_num_seqs, budget) rows of one query each, at the longest context (attention
  that gathers contexts, as the torch backend's does, peaks here);
- a chunk after a long cached prefix: min(budget, max_model_len - 1) queries ending at
  max_model_len (a [q_len, seq_len] score matrix per head).
Rows that only read the scratch cache share blocks: the decode rows all read one context's
blocks, so the scratch cache is one longest context, not max_num_seqs of them. Sampling then
runs for the most rows with every feature on (their [S, V] temporaries count too).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from conveyor.gpu.sampling import SamplingRow, sample_step
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.step_inputs import RowSpec, first_pass_inputs
from conveyor.wire.messages import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.gpu.backends.base import AttentionBackend
    from conveyor.gpu.models.base import CausalLM
    from conveyor.gpu.parallel.group import TensorParallel


class ProfiledRunner(Protocol):
    """What profile_run reads of the runner (gpu/step/runner.py ModelRunner, which imports this module)."""

    config: EngineConfig
    tp: TensorParallel
    device: torch.device
    block_size: int
    max_blocks_per_seq: int
    attn: AttentionBackend
    model: CausalLM


@dataclasses.dataclass(frozen=True)
class ProfileStep:
    name: str
    query_lens: list[int]  # new tokens per row
    seq_lens: list[int]  # context per row after the step
    block_tables: list[list[int]]  # per row, into a scratch pool of num_blocks

    @property
    def num_blocks(self) -> int:
        return 1 + max(max(table) for table in self.block_tables)


def profile_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> list[ProfileStep]:
    total, longest = max_num_batched_tokens, max(max_model_len, 1)

    def blocks(n: int, first: int = 0) -> list[int]:
        return list(range(first, first + -(-n // block_size)))

    lens = [min(longest, total - i) for i in range(0, total, longest)]
    tables, next_block = [], 0
    for n in lens:
        tables.append(blocks(n, next_block))
        next_block += len(tables[-1])
    steps = [ProfileStep("prefill", lens, lens, tables)]
    num_rows = min(max_num_seqs, total)
    steps.append(ProfileStep("decode", [1] * num_rows, [longest] * num_rows, [blocks(longest)] * num_rows))
    if longest > 1:
        chunk = min(total, longest - 1)
        steps.append(ProfileStep("chunk after cached prefix", [chunk], [longest], [blocks(longest)]))
    return steps


@torch.inference_mode()
def profile_run(runner: ProfiledRunner) -> None:
    """Run the profile steps on `runner`'s model, a scratch cache and scratch batches, then its
    sampling for the most rows; nothing of the runner's own state changes."""
    config, block_size = runner.config, runner.block_size
    model_cfg, sched = config.model, config.scheduler
    steps = profile_steps(sched.max_num_batched_tokens, sched.max_num_seqs, model_cfg.max_model_len, block_size)
    # Every sampling feature at once, so that the peak covers their [S, V] temporaries.
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        min_tokens=2,
        logit_bias={0: 1.0},
        logprobs=MAX_LOGPROBS,
        max_tokens=None,
    )
    kv_caches = runner.attn.allocate_kv_caches(max(step.num_blocks for step in steps), block_size)
    for step in steps:
        batch = PersistentBatch(len(step.query_lens), runner.max_blocks_per_seq, runner.device)
        specs = [
            RowSpec(batch.add(i, list(table), params), n - q, n, [0] * n, samples=True)
            for i, (q, n, table) in enumerate(zip(step.query_lens, step.seq_lens, step.block_tables))
        ]
        batch.sync()
        inputs = first_pass_inputs(specs, batch, runner.attn, block_size, model_cfg.sliding_window)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta, kv_caches)  # [T, H]
        if step is steps[0]:  # the prefill: T is the whole budget, enough rows to sample
            num_rows = min(sched.max_num_seqs, sched.max_num_batched_tokens)
            logits = runner.model.compute_logits(hidden[:num_rows])  # a collective: every rank gathers
            if runner.tp.samples:
                history = [0] * min(model_cfg.max_model_len, sched.max_num_batched_tokens)  # one output: min_tokens still bans EOS
                row = SamplingRow(params, history, len(history) - 1, [0])
                sample_step(logits, [row] * num_rows, model_cfg.eos_token_ids)
