"""An EAGLE-3 head proposing (`{"method": "eagle3", "model": DIR}`): one decoder layer fed the
target's own hidden states (the inputs of three of its layers, which the target keeps while it
runs: CausalLM.aux_layers) and the next token's embedding; the head and its layout are in
eagle3_head.py.

Alignment. The head's position i reads the target's features of position i and the token at i + 1,
and guesses the token at i + 2. So its KV at i needs a token the target's pass at i has not drawn
yet: each `follow` writes the positions whose next token the pass holds, [p, p + n - 1) of a row
computing [p, p + n), plus p - 1 from the features its last pass kept, and keeps the features of
its last positions (up to k + 1, a verifying row's) for the next. `propose` starts each decoding
row at num_computed - 1 (the features of the last computed position, the last token), then feeds
its own pre-norm output and argmax back for k - 1 steps, chained on the device (draft_passes.py).
Its follow then skips that p - 1: proposing wrote it.

After a verifying pass of [T, T + d] that accepted a drafts, the features of T + a are kept (the
target computed them from accepted tokens); the head's KV at T + a .. T + d, written from drafts,
is written again from T + a on, as the target's rejected slots are. A row whose features are not
kept (a prefix-cache hit starts past them; a fork's first pass) skips p - 1 and proposes from its
next pass on: a draft's KV that is stale or missing only costs acceptance, never exactness.

KV cache: its own tensors over the target's block tables (draft_passes.py). Tensor parallelism:
the head is whole on every rank (one layer: not worth splitting), fed the target's hidden states,
which every rank holds whole; each rank drafts alike and rank 0's drafts are the ones verified.
The target's vocab-parallel embedding, where the head has none of its own, is a collective: every
rank follows and proposes in step. CUDA graphs: off (every pass runs eagerly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.spec.draft_passes import DraftPasses, bytes_per_step
from conveyor.gpu.spec.eagle3_head import load_eagle3_head

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.gpu.backends.base import AttentionMetadata
    from conveyor.gpu.models.base import CausalLM
    from conveyor.gpu.parallel.group import TensorParallel
    from conveyor.gpu.step.passes import WorkerSeq
    from conveyor.gpu.step.persistent_batch import PersistentBatch
    from conveyor.gpu.step.platform import Platform
    from conveyor.gpu.step.step_inputs import PassInputs


class Eagle3Proposer:
    def __init__(self, config: EngineConfig, platform: Platform, batch: PersistentBatch, tp: TensorParallel, target: CausalLM) -> None:
        spec = config.speculative
        assert spec is not None and spec.draft is not None and spec.eagle is not None
        self.batch, self.device = batch, platform.device
        backend = platform.backend(config.parallel.attention_backend, spec.draft, config.cache.kv_dtype(spec.draft.dtype))
        self.head = load_eagle3_head(spec.draft, spec.eagle, platform.device, backend)
        self.target = target
        target.aux_layers = spec.eagle.aux_layers  # each of its passes keeps them as aux_hidden
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else target.model.embed_tokens
        self.passes = DraftPasses(batch, backend.attn, config.cache.block_size, spec.draft.sliding_window, tp)
        # Features kept per batch row: of positions [first, first + count) of sequence owner's
        # last pass, in features[row, :count] ([R, width, H], grown with the batch).
        self.width = spec.num_speculative_tokens + 1
        self.features = torch.zeros(0, self.width, spec.draft.hidden_size, dtype=getattr(torch, spec.draft.dtype), device=self.device)
        self.owner: list[int] = []
        self.first: list[int] = []
        self.count: list[int] = []
        self.proposed: set[int] = set()  # seq_ids whose position num_computed - 1 `propose` wrote this pass

    def step_cost(self, target: nn.Module) -> float:
        """A draft step's cost relative to a decode step of the target: the weight bytes each reads
        (an ESTIMATE: draft_passes.bytes_per_step; fc, run once per pass, left out)."""
        return bytes_per_step(self.head, skip=(self.head.fc,)) / bytes_per_step(target)

    @torch.inference_mode()
    def follow(self, inputs: PassInputs, rows: list[WorkerSeq]) -> None:
        """The head's KV of every position of the target's pass whose next token the pass holds
        (and of the one before, where kept and not proposed); then the pass's last features kept."""
        meta, aux = inputs.meta, self.target.aux_hidden
        assert meta is not None and aux is not None, "a pass with an EAGLE-3 head runs eagerly"
        features = self.head.fc(aux)  # [T, 3H] -> [T, H]
        self._grow()
        slots = [self.batch.slots[seq.seq_id] for seq in rows]
        positions: list[int] = []
        tokens: list[int] = []  # index into the pass's input_ids of each position's next token
        sources: list[int] = []  # index into [features ; kept rows] of each position's features
        kept: list[int] = []  # flat indices into self.features of the p - 1 features read
        query_lens, seq_lens, pass_slots = [], [], []
        at, num_tokens = 0, features.shape[0]
        for seq, slot, n, end in zip(rows, slots, meta.host_query_lens, meta.host_seq_lens):
            p = end - n
            low = p
            if seq.seq_id not in self.proposed and p > 0 and self._holds(slot, seq.seq_id, p - 1):
                low = p - 1
                sources.append(num_tokens + len(kept))
                kept.append(slot * self.width + p - 1 - self.first[slot])
            if end - 1 > low:  # positions [low, end - 1)
                positions.extend(range(low, end - 1))
                tokens.extend(range(at + low + 1 - p, at + n))
                sources.extend(range(at, at + n - 1))
                query_lens.append(end - 1 - low)
                seq_lens.append(end - 1)
                pass_slots.append(slot)
            at += n
        if positions:
            pool = torch.cat([features, self.flat.index_select(0, to_device(kept, torch.int64, self.device))]) if kept else features
            positions_t = to_device(positions, torch.int64, self.device)
            meta_d = self.passes.metadata(pass_slots, query_lens, seq_lens, positions_t)
            embeds = self.embed(inputs.input_ids.index_select(0, to_device(tokens, torch.int64, self.device)))
            hidden = pool.index_select(0, to_device(sources, torch.int64, self.device))
            self.head(embeds, hidden, positions_t, meta_d, self.passes.kv_caches[0])
        self._keep(features, rows, slots, meta.host_query_lens, meta.host_seq_lens)
        self.proposed = set()

    def _keep(
        self, features: torch.Tensor, rows: list[WorkerSeq], slots: list[int], query_lens: list[int], seq_lens: list[int]
    ) -> None:
        """Each row's features of its last min(n, width) positions -> its row of self.features."""
        dst: list[int] = []
        src: list[int] = []
        at = 0
        for seq, slot, n, end in zip(rows, slots, query_lens, seq_lens):
            w = min(n, self.width)
            dst.extend(range(slot * self.width, slot * self.width + w))
            src.extend(range(at + n - w, at + n))
            self.owner[slot], self.first[slot], self.count[slot] = seq.seq_id, end - w, w
            at += n
        self.flat.index_copy_(
            0, to_device(dst, torch.int64, self.device), features.index_select(0, to_device(src, torch.int64, self.device))
        )

    @torch.inference_mode()
    def propose(self, seqs: list[WorkerSeq], slots: list[int], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[r] greedy drafts for each decoding row whose features of its last
        computed position are kept (the others: none, this pass)."""
        limits = [k if self._holds(slot, seq.seq_id, seq.num_computed - 1) else 0 for seq, slot, k in zip(seqs, slots, max_drafts)]
        flat = self.flat

        def start(rows: list[int]) -> list[torch.Tensor]:
            index = [slots[r] * self.width + seqs[r].num_computed - 1 - self.first[slots[r]] for r in rows]
            ids = to_device([seqs[r].token_ids[-1] for r in rows], torch.int64, self.device)
            return [ids, flat.index_select(0, to_device(index, torch.int64, self.device))]

        def step(state: list[torch.Tensor], positions: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
            normed, prenorm = self.head(self.embed(state[0]), state[1], positions, meta, self.passes.kv_caches[0])
            return [self.head.draft(normed), prenorm]

        self.proposed = {seq.seq_id for seq, k in zip(seqs, limits) if k > 0}
        return self.passes.chain(seqs, slots, limits, -1, start, step)

    @property
    def flat(self) -> torch.Tensor:
        """The kept features as rows [R * width, H]: row slot * width + j is position first[slot] + j."""
        return self.features.view(-1, self.features.shape[-1])

    def _holds(self, slot: int, seq_id: int, position: int) -> bool:
        return slot < len(self.owner) and self.owner[slot] == seq_id and 0 <= position - self.first[slot] < self.count[slot]

    def _grow(self) -> None:
        """As many rows of kept features as the batch has (it doubles when forks outgrow it)."""
        rows = self.batch.num_rows
        if self.features.shape[0] < rows:
            grown = self.features.new_zeros(rows, *self.features.shape[1:])
            grown[: self.features.shape[0]] = self.features
            self.features = grown
            missing = rows - len(self.owner)
            self.owner += [-1] * missing
            self.first += [0] * missing
            self.count += [0] * missing
