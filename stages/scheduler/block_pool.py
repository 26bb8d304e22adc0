"""The KV block pool: fixed-size blocks handed out on demand, reference counted.

A block id indexes the worker's cache tensors ([2, num_blocks, block_size, kv_heads, head_dim]
per layer); the pool only does the bookkeeping. Reference counts are kept so blocks can later be
shared between holders (prefix caching, parallel sampling); a block returns to the free list when
its last holder frees it.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a table of `num_held` blocks so that it covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} KV blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
