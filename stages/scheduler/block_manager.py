"""The KV block manager: reference-counted blocks, the automatic prefix cache, LRU eviction.

It keeps the books on the worker's KV blocks (a block id indexes the cache tensors,
[2, num_blocks, block_size, kv_heads, head_dim] per layer) and on each Sequence's block table
(`block_ids`, as nano-vllm's block manager keeps it). The scheduler decides who runs and who is
preempted; it asks here whether and how much fits (`num_admittable`, `num_appendable`) and has
this class do the bookkeeping (`allocate_prompt`, `append`, `register_full_blocks`, `fork`,
`release`). Pure Python: no torch, no zmq.

Invariants: a block's reference count is the number of tables that name it (parallel samples
share their prompt, the prefix cache full blocks across requests), and a block with count 0 is in
the free list exactly once; a table covers its sequence's computed tokens and those scheduled
next, its first `num_registered_blocks` named in the prefix cache (`chain_hash`); a free named
block stays cached until the free list hands it out again (in the order `free` explains).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # sequence.py imports the hashes from here
    from conveyor.stages.scheduler.sequence import Sequence

ROOT_HASH = 0x9E3779B97F4A7C15  # the "parent" of a sequence's first block


def chain_hash(parent: int, tokens: Iterable[int]) -> int:
    """A full block's name in the prefix cache: hash((the name of the block before it, its tokens)),
    so a name covers the whole prefix up to the block's end. Python's tuple hash is 64-bit and
    deterministic for ints; a collision would need two different chains to agree on all 64 bits."""
    return hash((parent, tuple(tokens)))


class BlockCopy(NamedTuple):
    """Copy-on-write: a sequence about to write into a block it shares gets a copy of it."""

    position: int  # in the sequence's block table
    src: int  # the shared block
    dst: int  # the sequence's own copy, which the worker fills from src before the step


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
        self.newly_named: list[tuple[int, int]] | None = None  # (block, name) as named, where a tier copies them (kv_tiers.py)

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
        if not self.can_allocate(num):
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
        """Drop one holder of each block. A block left with none is free: unnamed, it goes to the
        head of the free list (nothing worth keeping); named, to its tail, keeping its prefix cache
        entry until `allocate` hands it out again, least recently freed first. A table is released
        from its tail, so a sequence's later blocks are evicted before its earlier ones (a
        prefix's head is the likeliest to recur)."""
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
            if self.newly_named is not None:
                self.newly_named.append((block, name))

    def take_named(self) -> list[tuple[int, int]]:
        """The (block, name) pairs named since the last call (a tier beyond the device asked)."""
        named, self.newly_named = self.newly_named or [], []
        return named

    # --- sequences' block tables --------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest prefix of a waiting sequence's known tokens
        (not yet shared), never the block of its last token, whose logits are needed. Nothing
        for a sequence with computed tokens, nor for one asking for prompt logprobs or pooling
        its prompt: a hit's tokens would never be computed, and neither their logprobs nor their
        hidden states are kept."""
        return self.lookup(seq.full_block_hashes(self.block_size, self.prefix_blocks(seq)))

    def prefix_blocks(self, seq: Sequence) -> int:
        """How many of a waiting sequence's first blocks a prefix cache may supply (match_prefix)."""
        params = seq.params
        if seq.num_computed_tokens or params.prompt_logprobs is not None or params.pooling is not None:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def num_revived(self, hits: list[int]) -> int:
        """Free blocks among `hits`: sharing them takes them out of the free pool."""
        return sum(1 for block in hits if self._ref_counts[block] == 0)

    def num_admittable(self, hits: list[int]) -> int:
        """Tokens past the prefix `hits` that the free pool can hold (a hit on a free block takes
        that block out of the pool)."""
        return (len(self._free) - self.num_revived(hits)) * self.block_size

    def allocate_prompt(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Start a sequence's table: the prefix `hits` shared (its tokens count as computed), then
        fresh blocks for the next `num_tokens` tokens (`num_admittable` allows them)."""
        self.share(hits)
        seq.block_ids = hits
        seq.num_registered_blocks = len(hits)  # hits are named already
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_ids += self.allocate(self.blocks_needed(seq.num_computed_tokens + num_tokens, len(hits)))

    def can_append_in_place(self, seq: Sequence) -> bool:
        """Whether the next token goes into a block the sequence already holds alone: appending
        it needs nothing (the common decode)."""
        computed = seq.num_computed_tokens
        bs = self.block_size
        return computed % bs != 0 and self._ref_counts[seq.block_ids[computed // bs]] == 1

    def num_appendable(self, seq: Sequence) -> int:
        """Tokens past the computed ones that the sequence's table and the free pool can hold. A
        shared block the first of them goes into costs one free block for its copy."""
        computed = seq.num_computed_tokens
        bs = self.block_size
        cow = computed % bs != 0 and self._ref_counts[seq.block_ids[computed // bs]] > 1
        return (len(seq.block_ids) + len(self._free) - cow) * bs - computed

    def append(self, seq: Sequence, num_tokens: int) -> BlockCopy | None:
        """Blocks for the sequence's next `num_tokens` tokens (`num_appendable` allows them). The
        copy to make first when the first of them goes into a block another sequence holds."""
        table, computed = seq.block_ids, seq.num_computed_tokens
        position = computed // self.block_size  # the block the first new token goes into
        copy = None
        if computed % self.block_size and self._ref_counts[table[position]] > 1:
            (own,) = self.allocate(1)
            copy = BlockCopy(position, table[position], own)
            table[position] = own
            self.free([copy.src])
        table += self.allocate(self.blocks_needed(computed + num_tokens, len(table)))
        return copy

    def register_full_blocks(self, seq: Sequence) -> None:
        """Name the sequence's blocks that filled since the last call in the prefix cache.

        Only blocks whose ids are all known (min(computed, known)): a pending draw's block waits
        for its id. The newest known id's KV may still be unwritten when its draw arrives, but a
        later pass or the next plan computes it before any plan that could hit the block, as the
        worker runs plans and passes in order: a pass that is not last promises the next (which
        computes the row unless its sequence stopped, and then the scheduler finished it first),
        and a last pass rolled its row back. So every named block's KV is written by a pass the
        worker really runs for this sequence."""
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= seq.num_registered_blocks or not self.enable_prefix_caching:
            return
        hashes = seq.full_block_hashes(self.block_size, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            self.register(seq.block_ids[i], hashes[i])
        seq.num_registered_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent's table."""
        child.block_ids = list(parent.block_ids)
        self.share(child.block_ids)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's whole table (it finished, or is preempted to be recomputed)."""
        self.free(seq.block_ids)
        seq.block_ids = []
        seq.num_registered_blocks = 0


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
