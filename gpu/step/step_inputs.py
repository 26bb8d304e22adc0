"""A forward pass's inputs, from the persistent batch and the host's per-sequence counts.

Two builders:
- `first_pass_inputs`: any step (decode rows and prompt chunks mixed). Token ids the host has
  (prompts, outputs it has seen) go up in one pinned copy; a decode row's input that the device
  sampled and the host has not seen yet is taken from `PersistentBatch.last_token` on the
  device. Positions and per-row lengths are host counts, known without waiting on the device.
- `next_pass_inputs`: pass k > 0 of a multi-step window, whose rows all decode. Everything
  advances on the device: positions are the first pass's plus k, the input ids are the
  last_token rows the pass before wrote, and the slot mapping follows from the block tables.

Both gather the rows' block tables from the batch with one index_select of their slots, and
hand the attention backend its metadata (the backend also reads host lengths, to size grids).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from conveyor.gpu.backends import AttentionBackend, AttentionMetadata
from conveyor.gpu.sampling.transfer import to_device
from conveyor.gpu.step.persistent_batch import PersistentBatch


@dataclasses.dataclass
class PassInputs:
    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata | None  # None: a CUDA graph runs the pass over its own static metadata
    logit_index: torch.Tensor  # [S] int64: each sampling row's last token in the pass (a verifying row's last 1 + d)
    slots: torch.Tensor  # [B] int64: each row's slot in the batch
    block_tables: torch.Tensor  # [B, max_blocks] int32, the rows' tables gathered
    num_rows: int
    all_decode: bool  # every row computes one token (a CUDA graph may run it)
    seq_lens: list[int]  # [B] host copy: each row's context after the pass
    # [T, H]: the first layer's input where a feature supplies it (images: gpu/step/features/vision.py);
    # None: the model embeds input_ids.
    input_embeds: torch.Tensor | None = None
    # [3, T] int64: M-RoPE's positions where a feature supplies them (Qwen2-VL's image sequences:
    # gpu/models/mrope.py); None: the model rotates by `positions`.
    rope_positions: torch.Tensor | None = None


@dataclasses.dataclass
class RowSpec:
    """What the first pass computes for one row: tokens [start, end) of the sequence, whose
    host-known ids are `known` (the sequence's ids so far; a shorter list than `end` means the
    token at end - 1 comes from the device), `slot` its batch row."""

    slot: int
    start: int
    end: int
    known: list[int]
    samples: bool
    num_logits: int = 1  # positions that draw, the row's last ones: 1 + its drafts when it verifies some


def first_pass_inputs(
    rows: list[RowSpec],
    batch: PersistentBatch,
    attn: AttentionBackend,
    block_size: int,
    sliding_window: int | None,
    with_metadata: bool = True,
) -> PassInputs:
    device = batch.device
    num_tokens = [r.end - r.start for r in rows]
    total = sum(num_tokens)
    input_ids = np.zeros(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    feedback_at: list[int] = []  # token index in the pass of each id taken from the device
    feedback_slots: list[int] = []
    logit_index: list[int] = []
    offset = 0
    for r, n in zip(rows, num_tokens):
        if n == 1:  # a decode row, most of a busy step: no slices
            if r.start < len(r.known):
                input_ids[offset] = r.known[r.start]
            else:  # sampled on the device, not seen here yet
                feedback_at.append(offset)
                feedback_slots.append(r.slot)
            positions[offset] = r.start
        else:
            known_end = max(r.start, min(r.end, len(r.known)))  # the host may lag by whole windows
            input_ids[offset : offset + known_end - r.start] = r.known[r.start : known_end]
            if known_end < r.end:  # its newest token: sampled on the device, not seen here yet
                assert known_end == r.end - 1, "only a row's last input may come from the device"
                feedback_at.append(offset + n - 1)
                feedback_slots.append(r.slot)
            positions[offset : offset + n] = np.arange(r.start, r.end)
        offset += n
        if r.samples:
            logit_index.extend(range(offset - r.num_logits, offset))

    ids = to_device(input_ids, torch.int64, device)
    if feedback_at:
        at = to_device(feedback_at, torch.int64, device)
        ids.index_copy_(0, at, batch.last_token.index_select(0, to_device(feedback_slots, torch.int64, device)))
    slots = to_device([r.slot for r in rows], torch.int64, device)
    seq_lens = [r.end for r in rows]
    tables = batch.tables_for(slots, -(-max(seq_lens) // block_size))
    positions_t = to_device(positions, torch.int64, device)
    meta = attn.build_metadata(num_tokens, seq_lens, tables, positions_t, block_size, sliding_window) if with_metadata else None
    return PassInputs(
        input_ids=ids,
        positions=positions_t,
        meta=meta,
        logit_index=to_device(logit_index, torch.int64, device),
        slots=slots,
        block_tables=tables,
        num_rows=len(rows),
        all_decode=max(num_tokens) == 1,
        seq_lens=seq_lens,
    )


def next_pass_inputs(
    first: PassInputs,
    k: int,
    active: list[int] | None,
    batch: PersistentBatch,
    attn: AttentionBackend,
    block_size: int,
    sliding_window: int | None,
    with_metadata: bool = True,
) -> PassInputs:
    """Pass k >= 1 of a window whose first pass is `first` (every row decoding one token), for
    the rows `active` (indices into the first pass's rows, ascending; None: all of them)."""
    device = batch.device
    rows = range(first.num_rows) if active is None else active
    seq_lens = [first.seq_lens[i] + k for i in rows]  # host counts: no wait on the device
    if active is None:
        slots, positions, tables = first.slots, first.positions + k, first.block_tables
    else:
        index = to_device(active, torch.int64, device)
        slots, positions = first.slots.index_select(0, index), first.positions.index_select(0, index) + k
        tables = first.block_tables.index_select(0, index)
    num_blocks = -(-max(seq_lens) // block_size)
    if num_blocks > tables.shape[1]:  # the window crossed into blocks past the first pass's width
        tables = batch.tables_for(slots, num_blocks)
    ids = batch.last_token.index_select(0, slots)  # [B]: each row's newest draw, on the device
    num_rows = len(seq_lens)
    meta = attn.build_metadata([1] * num_rows, seq_lens, tables, positions, block_size, sliding_window) if with_metadata else None
    logit_index = torch.arange(num_rows, device=device)
    return PassInputs(ids, positions, meta, logit_index, slots, tables, num_rows, True, seq_lens)


def with_metadata(inputs: PassInputs, attn: AttentionBackend, block_size: int, sliding_window: int | None) -> None:
    """Give a pass left to a decode graph (meta None: every row computes one token) its metadata,
    so it runs eagerly: for a feature that finds the pass needs what a graph does not take (an
    image placeholder's embedding in a one-token prompt chunk)."""
    num_ones = [1] * inputs.num_rows
    inputs.meta = attn.build_metadata(num_ones, inputs.seq_lens, inputs.block_tables, inputs.positions, block_size, sliding_window)
