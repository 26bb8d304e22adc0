"""The KV host tier's slots as the scheduler keeps their books (--kv-offloading-size): which block
name each slot holds, least recently used first, and the slots taken out of the tier for a while
(a swapped-out sequence's, a read from disk's). kv_tiers.py decides what moves; the worker's host
tier (gpu/kv/host_tier.py) holds the bytes. Pure Python: no torch, no zmq.

Invariant: a slot is free, holds one name, or is taken out (reserved) until `release` or `adopt`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class HostSlots:
    """Block names -> host slots, least recently used first; `warm`: (name, slot) pairs the slots
    hold already (read back from disk at start-up), least recently used first."""

    def __init__(self, num_slots: int, warm: Iterable[tuple[int, int]] = ()) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict(warm)
        taken = set(self._slot_of.values())
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in taken]  # popped from the end: slot 0 first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: int) -> bool:
        return name in self._slot_of

    def slot(self, name: int) -> int | None:
        """The slot holding `name` (not a use)."""
        return self._slot_of.get(name)

    def store(self, name: int) -> int | None:
        """The slot to copy a block named `name` into, evicting the least recently used name when
        every slot is taken; None when the tier holds that name already (it counts as a use), or
        when swapped-out sequences hold every slot."""
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            return None
        if not self._free and not self._slot_of:
            return None
        slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[name] = slot
        return slot

    def reserve(self, num: int, avoid: set[int], *, fewer: bool = False) -> list[int] | None:
        """`num` slots taken out of the tier (a swapped-out sequence's, or a disk read's, until
        `release` or `adopt`): free ones first, then the least recently used names' but those in
        `avoid`; None, and nothing taken, when there are not enough, unless `fewer`: then as many
        as there are."""
        evictable = [name for name, slot in self._slot_of.items() if slot not in avoid][: max(0, num - len(self._free))]
        if len(self._free) + len(evictable) < num:
            if not fewer:
                return None
            num = len(self._free) + len(evictable)
        for name in evictable:
            self._free.append(self._slot_of.pop(name))
        return [self._free.pop() for _ in range(num)]

    def release(self, slots: list[int]) -> None:
        self._free += slots

    def adopt(self, name: int, slot: int) -> None:
        """A reserved slot now holds the block `name` (read from disk): it joins the tier, the
        most recently used; or goes back free if the tier came to hold `name` meanwhile."""
        if name in self._slot_of:
            self._free.append(slot)
        else:
            self._slot_of[name] = slot

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
