"""ParamsTable: the sampling parameters the sampler reads per draw, kept on the device by slot.

A sequence's temperature, top_k, top_p and min_p never change, so they go up once, when the
sequence gets its slot in the persistent batch (gpu/step/persistent_batch.py), instead of as fresh
host lists every step. A step gathers its draws' rows with one `index_select` of their slots
(`gather`), and the sampler and filters read those tensors; which filters run at all is still
decided on the host from the SamplingParams, which the host has anyway (no device read).

Columns, [R] each: temperature float32 (1.0 for a greedy row: greedy draws are replaced by the
argmax at the end), top_k int64 (as given: 0 or >= V mean off), top_p float32, min_p float32.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.wire.messages import SamplingParams


@dataclasses.dataclass
class DrawParams:
    """One step's draws' parameters, [N] each, on the device (ParamsTable.gather)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32


class ParamsTable:
    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.device = device
        self.num_rows = 0
        self.temperature = torch.ones(0, device=device)
        self.top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self.top_p = torch.ones(0, device=device)
        self.min_p = torch.zeros(0, device=device)
        self.resize(num_rows)

    def resize(self, num_rows: int) -> None:
        """Grow to `num_rows` rows, keeping the existing ones."""
        old = self.num_rows
        for name, fill in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            column = getattr(self, name)
            grown = torch.full((num_rows,), fill, dtype=column.dtype, device=self.device)
            grown[:old] = column
            setattr(self, name, grown)
        self.num_rows = num_rows

    def set(self, slot: int, params: SamplingParams) -> None:
        """Row `slot` := the sequence's parameters (one small copy per column, once per sequence)."""
        self.temperature[slot] = 1.0 if params.greedy else params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p

    def copy_row(self, src: int, dst: int) -> None:
        for column in (self.temperature, self.top_k, self.top_p, self.min_p):
            column[dst] = column[src]

    def gather(self, slots: torch.Tensor) -> DrawParams:
        """slots [N] int64 on the device (a slot may repeat: a row's forks draw with its params)."""
        return DrawParams(*(column.index_select(0, slots) for column in (self.temperature, self.top_k, self.top_p, self.min_p)))
