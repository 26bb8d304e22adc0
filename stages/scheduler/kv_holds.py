"""Prefixes the KV tiers hold on the device for waiting sequences whose hit on disk is longer than
the host tier (kv_tiers.py): the host tier's slots are read full from disk, loaded into device
blocks held for the sequence, and read again, until its whole hit is on the device. Pure Python:
no torch, no zmq.

- `hold` keeps one reference on the sequence's device hits and on the blocks this plan loads
  for it, in place of what it held before. The loaded blocks are named in the prefix cache at
  the next plan (`begin_step`: no row of this plan reads them, and the worker's next plan waits
  for them), so the sequence's admission finds its whole hold as device hits and reads on past it.
- A hold never keeps anyone out of the pool: when a running sequence's next tokens, a waiting
  sequence's start or a swapped-out sequence's return find no room, every hold ends
  (`release_all`). Its blocks go free and named, still hits until the pool hands them out (free
  named blocks go last); those this plan loads stay out until the next, then go free too.
- A hold also ends when its sequence starts (its table shares the blocks) or ends.
- A sequence holds again only from the end of what it held (`may_hold`): its hits must cover
  its last hold. One whose hold yielded and was evicted meanwhile, or whose loaded blocks found
  no name (prefix caching off), loads what the host tier holds once and computes the rest, so
  that no sequence loads the same part again and again.

Invariant: each held block has one reference from here, besides its other holders'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.stages.scheduler.block_manager import BlockManager


class PrefixHolds:
    """Device blocks of `blocks` held for waiting sequences, by sequence id."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._held: dict[int, list[int]] = {}  # seq_id -> the blocks held for it, named, in prefix order
        self._landing: list[tuple[int, int, int]] = []  # (seq_id, block, name) loaded by this plan
        self._reach: dict[int, int] = {}  # seq_id -> prefix blocks its last hold covered, until it starts or ends

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held

    @property
    def landing(self) -> bool:
        """Whether blocks this plan loads wait for the next plan to be named."""
        return bool(self._landing)

    def held_blocks(self) -> list[int]:
        """Every block held here (one reference each), those landing included."""
        return [b for table in self._held.values() for b in table] + [b for _, b, _ in self._landing]

    def begin_step(self) -> None:
        """Before a plan is built: the blocks the plan before loaded are named, and stay held for
        their sequence if its hold lasted, else go free."""
        for seq_id, block, name in self._landing:
            self.blocks.register(block, name)  # unless an identical block was named meanwhile
            table = self._held.get(seq_id)
            if table is not None:
                table.append(block)
            else:
                self.blocks.free([block])
        self._landing = []

    def may_hold(self, seq_id: int, num_hits: int) -> bool:
        """Whether a sequence whose device hits are `num_hits` blocks may hold: they cover its last hold."""
        return num_hits >= self._reach.get(seq_id, 0)

    def hold(self, seq_id: int, hits: list[int], fresh: list[int], names: list[int]) -> None:
        """Hold `hits` (shared by the caller: their reference is now the hold's) and `fresh`,
        allocated and loaded by this plan for the blocks `names`, for the sequence, in place of
        what it held."""
        self.release(seq_id)
        self._held[seq_id] = list(hits)
        self._reach[seq_id] = len(hits) + len(fresh)
        self._landing += [(seq_id, block, name) for block, name in zip(fresh, names)]

    def forget(self, seq_id: int) -> None:
        """The sequence starts (or tries to: its table shares the blocks) or ends."""
        self.release(seq_id)
        self._reach.pop(seq_id, None)

    def release(self, seq_id: int) -> None:
        """The sequence's hold ends: its named blocks go free."""
        table = self._held.pop(seq_id, None)
        if table:
            self.blocks.free(table)

    def release_all(self) -> bool:
        """Every hold ends, for a sequence that finds no room in the pool; whether any block was held."""
        held = any(self._held.values())
        for seq_id in list(self._held):
            self.release(seq_id)
        return held
