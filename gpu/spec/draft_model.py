"""A draft model: a smaller checkpoint with the target's vocabulary proposes each row's drafts by
greedy decoding (`{"method": "draft_model", "model": DIR}`), e.g. the target cut to its first
layers (self-speculation).

Its KV cache is its own tensors, read through the target's block tables: one pool of block ids,
the draft's bytes per block added to the target's when the pool is sized, so the scheduler
allocates, shares, copies on write and frees one set of blocks for both. A block then holds the
draft's KV of the same tokens as the target's: the draft `follow`s every pass of the target over
the same inputs (prompt chunks, decodes, verified drafts), so whatever the target computed, the
draft computed too, prefix-cache hits included. Rejected drafts' slots are written again by the
next pass, for both.

`propose` decodes up to k tokens for each row granted a lookahead, batched: step j runs the rows
still wanting a draft, its input the argmax of step j - 1 (on the device: no host round trip
between steps), writing the draft's KV of the row's last token and its drafts into slots the
row's table holds. One copy brings all the drafts to the host. Drafts are argmax, so each is one
token with probability 1 and verify.py's exactness holds for sampled rows too.

Tensor parallelism: one rank only (the config refuses more). CUDA graphs: off with a draft
model (every pass runs eagerly, so both models see the same metadata).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.gpu.persistent_batch import PersistentBatch
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.step_inputs import PassInputs

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.config.model import ModelConfig
    from conveyor.gpu.passes import WorkerSeq
    from conveyor.gpu.platform import Platform


class DraftModel:
    def __init__(self, config: EngineConfig, platform: Platform, batch: PersistentBatch) -> None:
        assert config.speculative is not None and config.speculative.draft is not None
        self.config = config.speculative.draft
        self.batch, self.device = batch, platform.device
        self.block_size = config.cache.block_size
        backend = platform.backend(config.parallel.attention_backend, self.config, config.cache.kv_dtype(self.config.dtype))
        self.attn = backend.attn
        self.model = platform.load_model(self.config, backend)
        self.kv_caches: list[torch.Tensor] = []

    def step_cost(self, target: ModelConfig) -> float:
        """A draft step's cost relative to a decode step of the target: by their layers (an
        ESTIMATE: it leaves out the heads, which a self-speculation draft shares in size)."""
        return self.config.num_layers / target.num_layers

    def bytes_per_block(self) -> int:
        return self.attn.bytes_per_block(self.block_size)

    def allocate(self, num_blocks: int) -> None:
        """Its caches, as many blocks as the target's (the scratch block included)."""
        self.kv_caches = self.attn.allocate_kv_caches(num_blocks, self.block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.attn.copy_blocks(self.kv_caches, pairs)

    def follow(self, inputs: PassInputs) -> None:
        """The target's pass over the draft: its KV of the same tokens (no logits)."""
        assert inputs.meta is not None, "a pass with a draft model runs eagerly"
        self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    @torch.inference_mode()
    def propose(self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[r] greedy drafts for each sequence, whose ids are all on the host and
        whose last token is not computed yet (a decoding row); slots: their rows of the batch."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [r for r, k in enumerate(max_drafts) if k > 0]
        if not active:
            return drafts
        ids = to_device([seqs[r].token_ids[-1] for r in active], torch.int64, self.device)
        steps: list[tuple[list[int], torch.Tensor]] = []
        for j in range(max(max_drafts)):
            keep = [i for i, r in enumerate(active) if max_drafts[r] > j]
            if len(keep) < len(active):
                ids, active = ids.index_select(0, to_device(keep, torch.int64, self.device)), [active[i] for i in keep]
            positions = [seqs[r].num_computed + j for r in active]
            seq_lens = [p + 1 for p in positions]
            rows_t = to_device([slots[r] for r in active], torch.int64, self.device)
            tables = self.batch.tables_for(rows_t, -(-max(seq_lens) // self.block_size))
            positions_t = to_device(positions, torch.int64, self.device)
            window = self.config.sliding_window
            meta = self.attn.build_metadata([1] * len(active), seq_lens, tables, positions_t, self.block_size, window)
            hidden = self.model(ids, positions_t, meta, self.kv_caches)
            ids = self.model.compute_logits(hidden).argmax(dim=-1)  # [R_j]: the next input, on the device
            steps.append((active, ids))
        values = torch.cat([ids for _, ids in steps]).tolist()  # the one copy to the host
        at = 0
        for rows, _ in steps:
            for r, token in zip(rows, values[at : at + len(rows)]):
                drafts[r].append(token)
            at += len(rows)
        return drafts
