"""A draft model: a smaller checkpoint with the target's vocabulary proposes each row's drafts by
greedy decoding (`{"method": "draft_model", "model": DIR}`), e.g. the target cut to its first
layers (self-speculation).

Its KV cache is its own tensors, read through the target's block tables (draft_passes.py), so a
block holds the draft's KV of the same tokens as the target's: the draft `follow`s every pass of
the target over the same inputs (prompt chunks, decodes, verified drafts), so whatever the target
computed, the draft computed too, prefix-cache hits included. Rejected drafts' slots are written
again by the next pass, for both.

`propose` decodes up to k tokens for each row granted a lookahead, batched and chained on the
device (draft_passes.py), writing the draft's KV of the row's last token and its drafts. Drafts
are argmax, so each is one token with probability 1 and verify.py's exactness holds for sampled
rows too.

Tensor parallelism: sharded as the target (its heads and KV split alike, its projections'
collectives in step with every rank's); rank 0's argmax is broadcast as every rank's next input,
one small collective per draft step. CUDA graphs: off with a draft model (every pass runs
eagerly, so both models see the same metadata).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.gpu.parallel.shard import shard_model_config
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.spec.draft_passes import DraftPasses, bytes_per_step
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.step_inputs import PassInputs

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.gpu.backends.base import AttentionMetadata
    from conveyor.gpu.parallel.group import TensorParallel
    from conveyor.gpu.step.passes import WorkerSeq
    from conveyor.gpu.step.platform import Platform


class DraftModel:
    def __init__(self, config: EngineConfig, platform: Platform, batch: PersistentBatch, tp: TensorParallel) -> None:
        assert config.speculative is not None and config.speculative.draft is not None
        self.config = config.speculative.draft
        self.device, self.tp = platform.device, tp
        shard = shard_model_config(self.config, tp.size)  # sharded as the target: this rank's heads
        backend = platform.backend(config.parallel.attention_backend, shard, config.cache.kv_dtype(self.config.dtype))
        self.model = platform.load_model(self.config, dataclasses.replace(backend, tp=tp))
        self.passes = DraftPasses(batch, backend.attn, config.cache.block_size, self.config.sliding_window, tp)

    def step_cost(self, target: nn.Module) -> float:
        """A draft step's cost relative to a decode step of the target: the weight bytes each reads
        (an ESTIMATE: draft_passes.bytes_per_step)."""
        return bytes_per_step(self.model) / bytes_per_step(target)

    def follow(self, inputs: PassInputs, rows: list[WorkerSeq]) -> None:
        """The target's pass over the draft: its KV of the same tokens (no logits)."""
        assert inputs.meta is not None, "a pass with a draft model runs eagerly"
        self.model(inputs.input_ids, inputs.positions, inputs.meta, self.passes.kv_caches)

    @torch.inference_mode()
    def propose(self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[r] greedy drafts for each sequence, whose ids are all on the host and
        whose last token is not computed yet (a decoding row); slots: their rows of the batch.
        Step j reads the last token (then draft j) at num_computed + j."""

        def start(rows: list[int]) -> list[torch.Tensor]:
            return [to_device([seqs[r].token_ids[-1] for r in rows], torch.int64, self.device)]

        def step(state: list[torch.Tensor], positions: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
            hidden = self.model(state[0], positions, meta, self.passes.kv_caches)
            logits = self.model.compute_logits(hidden)  # [R, V] on rank 0, [R, 0] on the others
            ids = logits.argmax(dim=-1) if self.tp.samples else state[0].new_empty(hidden.shape[0])
            return [self.tp.broadcast_first(ids)]  # every rank's next input: rank 0's argmax

        return self.passes.chain(seqs, slots, max_drafts, 0, start, step)
