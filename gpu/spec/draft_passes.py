"""DraftPasses: a model-based proposer's (draft_model.py, eagle3.py) own KV cache and the passes
it runs on it: the cache's tensors, indexed by the target's block tables (one pool of block ids,
its bytes per block added to the target's when the pool is sized, so the scheduler allocates,
shares, copies on write and frees one set of blocks for both); the passes' attention metadata;
and the greedy chain that proposes.

`chain` decodes up to k tokens for each row, batched: step j runs the rows still wanting a draft,
its state (the input ids first, then whatever else the proposer carries, e.g. EAGLE's features)
the output of step j - 1, on the device: no host round trip between steps. Step j of a row sits
at position num_computed + offset + j, writing the proposer's KV there, into slots the row's
table holds. One copy brings all the drafts to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.gpu.sampling.transfer import to_device

if TYPE_CHECKING:
    from conveyor.gpu.backends.base import AttentionBackend, AttentionMetadata
    from conveyor.gpu.parallel.group import TensorParallel
    from conveyor.gpu.step.passes import WorkerSeq
    from conveyor.gpu.step.persistent_batch import PersistentBatch

# start(rows) -> the state of those rows (each tensor [R, ...], the ids [R] first);
# step(state, positions [R], meta) -> the next state, its ids the drafts of this step.
Start = Callable[[list[int]], list[torch.Tensor]]
Step = Callable[[list[torch.Tensor], torch.Tensor, "AttentionMetadata"], list[torch.Tensor]]


class DraftPasses:
    def __init__(
        self, batch: PersistentBatch, attn: AttentionBackend, block_size: int, window: int | None, tp: TensorParallel
    ) -> None:
        self.batch, self.attn, self.block_size, self.window = batch, attn, block_size, window
        self.tp = tp  # the drafts are rank 0's
        self.device = batch.device
        self.kv_caches: list[torch.Tensor] = []  # one per proposer layer, in the attention backend's layout

    def bytes_per_block(self) -> int:
        return self.attn.bytes_per_block(self.block_size)

    def allocate(self, num_blocks: int) -> None:
        """Its caches, as many blocks as the target's (the scratch block included)."""
        self.kv_caches = self.attn.allocate_kv_caches(num_blocks, self.block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.attn.copy_blocks(self.kv_caches, pairs)

    def metadata(self, slots: list[int], query_lens: list[int], seq_lens: list[int], positions: torch.Tensor) -> AttentionMetadata:
        """A pass over the rows in `slots` (batch rows): query_lens[r] tokens of row r, its context
        seq_lens[r] after them, positions [T] on the device."""
        rows = to_device(slots, torch.int64, self.device)
        tables = self.batch.tables_for(rows, -(-max(seq_lens) // self.block_size))
        return self.attn.build_metadata(query_lens, seq_lens, tables, positions, self.block_size, self.window)

    def chain(
        self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int], offset: int, start: Start, step: Step
    ) -> list[list[int]]:
        """Up to max_drafts[r] greedy drafts for each sequence; slots: their batch rows."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [r for r, k in enumerate(max_drafts) if k > 0]
        if not active:
            return drafts
        state = start(active)
        steps: list[tuple[list[int], torch.Tensor]] = []
        for j in range(max(max_drafts)):
            keep = [i for i, r in enumerate(active) if max_drafts[r] > j]
            if len(keep) < len(active):
                index = to_device(keep, torch.int64, self.device)
                state, active = [t.index_select(0, index) for t in state], [active[i] for i in keep]
            positions = [seqs[r].num_computed + offset + j for r in active]
            positions_t = to_device(positions, torch.int64, self.device)
            meta = self.metadata([slots[r] for r in active], [1] * len(active), [p + 1 for p in positions], positions_t)
            state = step(state, positions_t, meta)
            steps.append((active, state[0]))
        # Rank 0's drafts on every rank (the ranks verify alike), in the one copy to the host.
        values = self.tp.broadcast_first(torch.cat([ids for _, ids in steps])).tolist()
        at = 0
        for rows, _ in steps:
            for r, token in zip(rows, values[at : at + len(rows)]):
                drafts[r].append(token)
            at += len(rows)
        return drafts


def bytes_per_step(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """The weight bytes a decode step of `model` reads, as stored (packed where quantized): every
    parameter once, but for embedding tables that are not also the output head (a step reads a
    row of those) and the modules in `skip`. A one-row step is bound by reading them, so their
    ratio is an ESTIMATE of two models' relative step times."""
    seen: dict[int, int] = {}
    skipped = {id(p) for m in skip for p in m.parameters()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m.weight is not None}
    for module in model.modules():
        packed = getattr(module, "quantized", None)
        if packed is not None and not isinstance(module, nn.Embedding):
            seen[id(packed)] = packed.nbytes
        for p in module.parameters(recurse=False):
            if id(p) not in skipped and (id(p) not in tables or id(p) in heads):
                seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())
