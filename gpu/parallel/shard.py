"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron's split).

The layer that owns a parameter declares its `Split` (gpu/models/layers.py); the model's weight
loading (`CausalLM.load_weights`, moe.py's `load_moe_weights`) calls `cut` on every tensor the
loader streams, so a rank only ever holds its own slice. `shard_model_config` is one rank's
ModelConfig, from which the attention backend sizes its KV layout and cache.

Invariants: a split dimension is a number of *units* (a head of head_dim rows, one intermediate
row, one token's row), and n units go over `size` ranks only evenly or replicated (`can_split`):
- size divides n: rank r holds units [r * n / size, (r + 1) * n / size);
- n divides size: rank r holds one unit, number r * n // size, replicated on size / n ranks (KV
  heads when there are fewer than ranks: each rank's query heads read their own copy);
anything else is refused when the config is built (conveyor/engine_config.py). A fused tensor's
parts are cut each on its own (`Split.parts`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from conveyor.config.model import ModelConfig


def can_split(n: int, size: int) -> bool:
    """Whether n units go over `size` ranks: split evenly, or replicated."""
    return n % size == 0 or size % n == 0


def local_units(n: int, size: int) -> int:
    """Units of n a rank holds."""
    assert can_split(n, size), f"{n} units cannot go over {size} ranks"
    return n // size if n % size == 0 else 1


def unit_range(n: int, size: int, rank: int) -> range:
    """The units of n that rank `rank` holds."""
    local = local_units(n, size)
    first = rank * local if n % size == 0 else rank * n // size
    return range(first, first + local)


def padded(n: int, size: int) -> int:
    """n rounded up to a multiple of size (the vocabulary)."""
    return -(-n // size) * size


@dataclasses.dataclass(frozen=True)
class Split:
    """How a parameter is cut from the checkpoint's full tensor: along `dim`, whose length is
    sum(units * unit_size) over `parts`, each part cut on its own and the rank's slices
    concatenated in order."""

    dim: int
    # (units, rows per unit) of each part, in the tensor's order: a fused projection has several
    # (Phi-3's qkv_proj is q heads, then KV heads, then KV heads; gate_up_proj gate rows, then up rows).
    parts: tuple[tuple[int, int], ...]
    # One part (the vocabulary) whose units are rounded up to a multiple of the ranks with zero
    # rows, dropped again after the logits are gathered.
    pad: bool = False

    def local_size(self, size: int) -> int:
        """The rank's length along `dim`."""
        if self.pad:
            ((n, unit),) = self.parts
            return padded(n, size) // size * unit
        return sum(local_units(n, size) * unit for n, unit in self.parts)


def cut(full: torch.Tensor, split: Split | None, rank: int, size: int) -> torch.Tensor:
    """The slice of `full` that rank `rank` of `size` holds (None: the whole tensor)."""
    if split is None or size == 1 and not split.pad:
        return full
    if split.pad:
        ((n, unit),) = split.parts
        extra = (padded(n, size) - n) * unit
        if extra:
            shape = list(full.shape)
            shape[split.dim] = extra
            full = torch.cat([full, full.new_zeros(shape)], dim=split.dim)
    ranges = pieces(split, rank, size, full.shape[split.dim])
    slices = [full.narrow(split.dim, start, length) for start, length in ranges]
    return torch.cat(slices, dim=split.dim) if len(slices) > 1 else slices[0]


def pieces(split: Split, rank: int, size: int, length: int) -> list[tuple[int, int]]:
    """(start, length) along split.dim of each part's slice that rank `rank` holds, in a tensor
    `length` long there (padded already where split.pad); a ValueError if the parts disagree."""
    parts = split.parts
    if split.pad:
        ((n, unit),) = parts
        parts = ((padded(n, size), unit),)
    ranges, start = [], 0
    for n, unit in parts:
        units = unit_range(n, size, rank)
        ranges.append((start + units.start * unit, len(units) * unit))
        start += n * unit
    if start != length:
        raise ValueError(f"a tensor of {length} along dim {split.dim} is not {split.parts}")
    return ranges


def shard_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's share of `config`: its query and KV heads and its MLP rows (the vocabulary,
    the hidden size and head_dim are whole on every rank)."""
    if size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=local_units(config.num_heads, size),
        num_kv_heads=local_units(config.num_kv_heads, size),
        intermediate_size=local_units(config.intermediate_size, size),
    )


def splits_of(model: nn.Module) -> dict[str, Split]:
    """Every split parameter of `model` by its full name, as its layer declares it (`splits`)."""
    return {
        f"{prefix}.{name}" if prefix else name: split
        for prefix, module in model.named_modules()
        for name, split in getattr(module, "splits", {}).items()
    }
