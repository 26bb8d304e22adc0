"""PersistentBatch: the device-resident state of every sequence the worker holds, one row each.

Each live sequence owns a row (a "slot") of tensors that persist across steps, so a plan's diffs
touch only the rows it names instead of rebuilding a step's inputs from Python lists. The runner
adds, removes, forks and updates rows; gpu/step/step_inputs.py reads them.

- `block_tables` [R, M] int32, M = ceil(max_model_len / block_size), padded with block 0: row s
  is slot s's table. Writes go to a pinned host mirror, and `sync()` copies the changed rows up
  in one indexed, non-blocking copy (on a CPU the mirror is the table);
- `last_token` [R] int64: each slot's newest id, written on the device by `feed_back`, so a
  sampled id never visits the host before the step that consumes it;
- `params` (gpu/sampling/params_table.py): each slot's temperature, top_k, top_p and min_p,
  written once when the sequence gets its slot; a step's draws gather theirs on the device.
Slots come from a free list and are indexed, not contiguous; when more sequences are live than
rows exist (forks can take a request past --max-num-seqs for a moment), the tensors double.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.gpu.sampling.params_table import ParamsTable
from conveyor.wire.messages import SamplingParams


class PersistentBatch:
    host_tables: torch.Tensor  # [R, M] int32, pinned on CUDA
    host_tables_np: np.ndarray  # the same memory, for cheap row writes
    block_tables: torch.Tensor  # [R, M] int32 on the device (the host tensor itself on a CPU)
    last_token: torch.Tensor  # [R] int64 on the device

    def __init__(self, max_rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.slots: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = []
        self._dirty: set[int] = set()  # rows whose host table changed since the last sync
        self.num_rows = 0
        self.params = ParamsTable(0, device)
        self._allocate(max(1, max_rows))

    def _allocate(self, num_rows: int) -> None:
        """(Re)size to `num_rows` rows, keeping what the existing rows hold."""
        old_rows = self.num_rows
        pin = self.device.type == "cuda"
        host = torch.zeros((num_rows, self.max_blocks), dtype=torch.int32, pin_memory=pin)
        last = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        if old_rows:
            host[:old_rows] = self.host_tables
            last[:old_rows] = self.last_token
        self.host_tables = host
        self.host_tables_np = host.numpy()
        self.block_tables = host if self.device.type == "cpu" else host.to(self.device)
        self.last_token = last
        self.params.resize(num_rows)
        self._free.extend(range(num_rows - 1, old_rows - 1, -1))  # lowest row first
        self.num_rows = num_rows

    # --- rows -----------------------------------------------------------------------------

    def add(self, seq_id: int, block_table: list[int], params: SamplingParams | None = None) -> int:
        """A row for `seq_id` (a known id is replaced: a resume after preemption) holding
        `block_table` and `params` (None: a fork, which copies its parent's); returns its slot."""
        if seq_id in self.slots:
            self.remove(seq_id)
        if len(block_table) > self.max_blocks:
            raise ValueError(f"seq {seq_id}: {len(block_table)} blocks exceed the {self.max_blocks} a sequence may hold")
        if not self._free:
            self._allocate(2 * self.num_rows)
        slot = self._free.pop()
        self.slots[seq_id] = slot
        row = self.host_tables_np[slot]
        row[:] = 0
        row[: len(block_table)] = block_table
        self._dirty.add(slot)
        if params is not None:
            self.params.set(slot, params)
        return slot

    def remove(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
            self._dirty.discard(slot)

    def fork(self, parent: int, child: int) -> int:
        """A row for `child` with the parent's block table (the child's last token is written
        by the draw that creates it)."""
        parent_slot = self.slots[parent]
        slot = self.add(child, [])
        self.host_tables_np[slot] = self.host_tables_np[parent_slot]
        self.params.copy_row(parent_slot, slot)
        return slot

    def set_blocks(self, seq_id: int, start: int, block_ids: list[int]) -> None:
        """Table entries [start, start + len(block_ids)) of the sequence's row := block_ids."""
        if start + len(block_ids) > self.max_blocks:
            raise ValueError(f"seq {seq_id}: {start + len(block_ids)} blocks exceed the {self.max_blocks} a sequence may hold")
        slot = self.slots[seq_id]
        self.host_tables_np[slot, start : start + len(block_ids)] = block_ids
        self._dirty.add(slot)

    # --- device side ------------------------------------------------------------------------

    def sync(self) -> None:
        """Copy the rows whose host tables changed to the device: one gather of the pinned rows
        and one non-blocking indexed copy. A no-op on a CPU, where host and device are one."""
        if not self._dirty:
            return
        if self.device.type != "cpu":
            rows = torch.tensor(sorted(self._dirty), dtype=torch.int64)
            staged = self.host_tables.index_select(0, rows).pin_memory()  # [D, M]
            rows_dev = rows.pin_memory().to(self.device, non_blocking=True)
            self.block_tables.index_copy_(0, rows_dev, staged.to(self.device, non_blocking=True))
        self._dirty.clear()

    def tables_for(self, slots: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """slots [B] int64 on the device -> their block tables [B, num_blocks] int32 (after sync)."""
        return self.block_tables[:, :num_blocks].index_select(0, slots)  # a fresh, contiguous [B, num_blocks]

    def feed_back(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """last_token[slots[i]] := token_ids[i] on the device: slots [N] int64, ids [N] int64."""
        self.last_token.index_copy_(0, slots, token_ids)
