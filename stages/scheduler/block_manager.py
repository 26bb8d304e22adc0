"""The KV block manager: reference-counted blocks, the automatic prefix cache, LRU eviction.

A block id indexes the worker's cache tensors ([2, num_blocks, block_size, kv_heads, head_dim]
per layer); this class only keeps the books. A block is held by every sequence whose block table
names it (reference count = holders), so parallel samples share their prompt and the prefix
cache shares full blocks between requests.

Prefix cache: a full block is named by a chained hash, hash((hash of the block before it, its
tokens)), so a name covers the whole prefix up to the block's end. When the last holder frees a
named block it stays in the cache while free, and is only evicted (renamed) when the free list
hands it out again: least recently freed first, unnamed blocks before named ones, and a
sequence's later blocks before its earlier ones (a prefix's head is the likeliest to recur).
Python's tuple hash is 64-bit and deterministic for ints; a collision would need two different
chains to agree on all 64 bits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

ROOT_HASH = 0x9E3779B97F4A7C15  # the "parent" of a sequence's first block


def chain_hash(parent: int, tokens: Iterable[int]) -> int:
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # chained hash -> block holding that prefix
        # Free blocks, next to be handed out first. A block with ref 0 is in here exactly once.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cache_queries = 0  # blocks looked up
        self.num_cache_hits = 0  # blocks found

    # --- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to add to a table of `num_held` blocks so that it covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    # --- allocation ---------------------------------------------------------------------

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Fresh blocks (ref 1), evicting the prefix-cache names of the free blocks taken."""
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(num):
            block, _ = self._free.popitem(last=False)
            name = self._hash[block]
            if name is not None:
                del self._cached[name]
                self._hash[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each block (a fork, or a prefix-cache hit reviving a free block)."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a sequence's table is released from its tail."""
        for block in reversed(blocks):
            count = self._ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"KV block {block} freed twice")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None
                if self._hash[block] is None:  # nothing worth keeping: hand it out first
                    self._free.move_to_end(block, last=False)

    # --- prefix cache -------------------------------------------------------------------

    def lookup(self, hashes: list[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (not yet shared)."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for name in hashes:
            block = self._cached.get(name)
            if block is None:
                break
            found.append(block)
        self.num_cache_queries += len(hashes)
        self.num_cache_hits += len(found)
        return found

    def register(self, block: int, name: int) -> None:
        """Name a block that just became full. If another block already holds the same prefix
        (two identical prompts computed in one step), this one stays unnamed."""
        if self.enable_prefix_caching and name not in self._cached and self._hash[block] is None:
            self._cached[name] = block
            self._hash[block] = name


def kv_slots(blocks: BlockManager, tables: Iterable[tuple[list[int], int]]) -> tuple[int, int]:
    """(token slots in held blocks, slots holding a computed token), from every holder's (block
    table, computed tokens); shared blocks count once. A full block wastes nothing however many
    hold it, so only each table's tail is visited."""
    bs = blocks.block_size
    allocated = blocks.num_used * bs
    tail_fill: dict[int, int] = {}  # block -> tokens in it, from each first non-full block on
    for table, computed in tables:
        for i in range(computed // bs, len(table)):
            tail_fill[table[i]] = max(tail_fill.get(table[i], 0), min(bs, computed - i * bs))
    return allocated, allocated - sum(bs - fill for fill in tail_fill.values())
