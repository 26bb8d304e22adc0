"""The KV tiers beyond the device pool, as the scheduler keeps their books (--kv-offloading-size):
which prefix-cache blocks the worker's host tier holds, in which slot, and what moves each step.
The worker moves the bytes (gpu/step/features/kv_offload.py); this decides. Pure Python: no
torch, no zmq.

- Saves, write-through: a block named in the prefix cache (full, its tokens known) is copied to
  a host slot by the next plan, unless the tier holds its name already. The next plan, because
  a block named while plan M is built is computed by plan M's passes, and the worker applies a
  plan's copies before its passes: so the saves of plan M + 1 read KV that is written. The
  device pool's eviction then costs nothing, and what the device evicts the host still holds.
- Loads, one step ahead: a waiting sequence whose prefix runs on past its device hits into the
  host tier has those blocks loaded into fresh device blocks by this plan and waits a step; the
  blocks are held and unnamed meanwhile (no row of this plan reads them), then named and freed
  into the prefix cache at the next step, where its admission finds them as device hits. So a
  load overlaps the pass of the plan that carries it, and only its own request waits for it.
- The host tier's slots are evicted least recently used first (a save or a hit uses a slot).

Invariant: within a plan the worker applies saves, then loads, then runs passes; a plan's saves
are decided before its loads, so a slot a load reads is never a save's destination in one plan.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.stages.scheduler.block_manager import BlockManager
    from conveyor.stages.scheduler.sequence import Sequence


class HostSlots:
    """Block names -> host slots, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: int) -> bool:
        return name in self._slot_of

    def store(self, name: int) -> int | None:
        """The slot to copy a block named `name` into, evicting the least recently used name when
        every slot is taken; None when the tier holds that name already (it counts as a use)."""
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            return None
        slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[name] = slot
        return slot

    def lookup(self, names: list[int]) -> list[int]:
        """The slots holding the longest run of `names` from its start (each a use)."""
        slots = []
        for name in names:
            slot = self._slot_of.get(name)
            if slot is None:
                break
            self._slot_of.move_to_end(name)
            slots.append(slot)
        return slots


class KvTiers:
    def __init__(self, blocks: BlockManager, num_host_slots: int) -> None:
        self.blocks = blocks
        self.host = HostSlots(num_host_slots)
        blocks.newly_named = []  # the block manager now lists each block it names (take_named)
        self.saves: list[tuple[int, int]] = []  # this plan's (device block, host slot)
        self.loads: list[tuple[int, int]] = []  # this plan's (host slot, device block)
        self._loaded: list[tuple[int, int]] = []  # (device block, name) loaded by the plan before, to name now
        self._prefetch_step: dict[int, int] = {}  # seq_id -> the step that loaded its blocks
        self.num_host_hits = 0  # blocks loaded back from the host tier (each a device miss it saved)
        self.num_saved = 0
        self.num_loaded = 0

    @property
    def holding(self) -> bool:
        """Whether loaded blocks wait for the next step to join the prefix cache."""
        return bool(self._loaded)

    def held_blocks(self) -> list[int]:
        """The device blocks the tier holds (one reference each): loaded, not yet named."""
        return [block for block, _ in self._loaded]

    def begin_step(self, step: int) -> None:
        """Before plan `step` is built: the blocks the plan before loaded join the prefix cache
        (free, so the waiting sequence that asked for them finds them as hits), and this plan's
        saves are the blocks named since the plan before was built."""
        self.saves, self.loads = [], []
        blocks = self.blocks
        if self._loaded:
            for block, name in self._loaded:
                blocks.register(block, name)  # unless an identical block was named meanwhile
            blocks.free(self.held_blocks())
            self._loaded = []
        for block, name in blocks.take_named():
            slot = self.host.store(name)
            if slot is not None:
                self.saves.append((block, slot))
        self.num_saved += len(self.saves)
        self._prefetch_step = {seq_id: s for seq_id, s in self._prefetch_step.items() if s >= step - 1}

    def prefetch(self, seq: Sequence, hits: list[int], step: int) -> bool:
        """Load the blocks of `seq`'s prefix past its device `hits` that the host tier holds, if
        any, into fresh device blocks (leaving a block for the rest of its prompt); True when it
        waits for them (admitted at the next step). A sequence whose load was lost meanwhile
        (the pool evicted the loaded blocks) is not loaded twice in a row: it computes them."""
        blocks = self.blocks
        limit = blocks.prefix_blocks(seq)
        if len(hits) >= limit or self._prefetch_step.get(seq.seq_id, -2) >= step - 1:
            return False
        names = seq.full_block_hashes(blocks.block_size, limit)[len(hits) :]
        slots = self.host.lookup(names)
        if not slots or not blocks.can_allocate(len(slots) + 1 + blocks.num_revived(hits)):
            return False
        names = names[: len(slots)]
        blocks.share(hits)  # held while the fresh blocks are taken, so that none of them is evicted
        fresh = blocks.allocate(len(slots))
        blocks.free(hits)
        self.loads += zip(slots, fresh)
        self._loaded += zip(fresh, names)
        self._prefetch_step[seq.seq_id] = step
        self.num_host_hits += len(slots)
        self.num_loaded += len(slots)
        return True
