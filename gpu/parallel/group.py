"""TensorParallel: one engine's worker ranks as a torch.distributed group, and the three
collectives the sharded model and the sampling split use.

- `all_reduce(x)`: the sum over ranks, in place (a row-parallel projection's partial products,
  a vocab-parallel embedding's masked lookups, an MoE block's partial expert sums);
- `gather_first(x, dim)`: every rank's shard concatenated along `dim` on rank 0, the rank that
  samples (the LM head's vocabulary shards); the others get an empty tensor, as they do not sample;
- `broadcast_first(x)`: rank 0's tensor on every rank (the sampled ids).

With one rank (`SINGLE`, the default everywhere) nothing is initialised and every collective
returns its input: the tp = 1 model is the unsharded one, at no cost. Collectives run on the
model's device (gloo on a CPU, NCCL on CUDA); rendezvous.py forms the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallel:
    """Rank `rank` of `size` ranks; `group` is the torch.distributed process group (None: one rank)."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        assert (size == 1) == (group is None) and 0 <= rank < size
        self.rank, self.size, self.group = rank, size, group

    @property
    def samples(self) -> bool:
        """Whether this rank samples: rank 0 draws, the others take its ids (sampling.py)."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x [..., n, ...] on each rank -> [..., size * n, ...] on rank 0, rank order along `dim`;
        an empty tensor (0 along `dim`) on the others."""
        if self.group is None:
            return x
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.group)
            return x.narrow(dim, 0, 0)
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, shards, dst=0, group=self.group)
        return torch.cat(shards, dim=dim)

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), in place."""
        if self.group is not None:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"


SINGLE = TensorParallel()  # one rank: no group, every collective the identity
