"""The KV tiers beyond the device pool, as the scheduler keeps their books (--kv-offloading-size):
which prefix-cache blocks the worker's host tier holds, in which slot, and what moves each step.
The worker moves the bytes (gpu/step/features/kv_offload.py); this decides. Pure Python: no
torch, no zmq.

- Saves, write-through: a block named in the prefix cache (full, its tokens known) is copied to
  a host slot by the next plan, unless the tier holds its name already. The next plan, because
  a block named while plan M is built is computed by plan M's passes, and the worker applies a
  plan's copies before its passes: so the saves of plan M + 1 read KV that is written. The
  device pool's eviction then costs nothing, and what the device evicts the host still holds.
- Loads, in the plan that admits the sequence: a waiting sequence whose prefix runs on past its
  device hits into the host tier has those blocks loaded into fresh device blocks, named at once
  in the prefix cache, and starts in the same plan after them. The worker's first pass of that
  plan waits for the copies its rows read, so the sequence waits for its own copy (~40 us a
  block of Llama-3-8B over PCIe 5.0), not for a step (~6.6 ms), and so does the rest of that
  pass: a plan loads at most `max_load_now` blocks this way (LOAD_NOW_BLOCKS, under half a step
  at that shape). Measured on the emulated H100 (docs/benchmarks/kv-tiers.md), waiting a step
  for each hit cost about what the tier saved in prefill.
- Loads one step ahead, where the load would not be hidden or would gain nothing: past that
  bound, or when the sequence would not start in this plan anyway (a prompt that must run whole
  and does not fit what is left of the budget). The blocks are held and unnamed meanwhile (no
  row of this plan reads them; the worker's next plan waits for them), then named and freed
  into the prefix cache at the next step, where its admission finds them as device hits; it is
  set aside meanwhile, and the sequences behind it are admitted. Swap resume (below) always
  loads one step ahead.
- The host tier's slots are evicted least recently used first (a save or a hit uses a slot).
  With --kv-disk-dir the worker writes each saved block through to disk and, at start-up, reads
  the most recently used ones back into its slots: those come in as `warm`.
- Reads from disk, on a hit: a waiting sequence whose prefix runs on past the device and the
  host tier into blocks the disk holds (kv_disk.py's index) has them read into host slots taken
  out of the books (the plan's `kv_fetches`; the worker reads on a thread of its own and every
  rank answers with KvFetched). It waits, set aside so that the sequences behind it are
  admitted, until every rank has answered for its blocks (or kv_disk.FETCH_WAIT_S passed); what
  was read is then a host hit, loaded as above. Nothing counts before every rank has checked its
  bytes: a read that failed is a miss, and the rest of the prefix is computed. A hit longer than
  the host tier is read a part at a time, each part loaded into device blocks held for the
  sequence before the next is read (kv_holds.py); a hold yields to anyone short of room.

Invariant: within a plan the worker applies saves, then loads, then starts its disk reads, then
runs passes; a plan's saves are decided before its loads and reads, so a slot a load reads or a
save writes is never a read's destination in one plan, nor (for a save's) a swap's. A set-aside
sequence keeps its place in the waiting queue: it is the first considered at the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from conveyor.stages.scheduler.kv_disk import DiskBooks
from conveyor.stages.scheduler.kv_holds import PrefixHolds
from conveyor.stages.scheduler.kv_host import HostSlots
from conveyor.wire.step import NO_NAME

if TYPE_CHECKING:
    from conveyor.stages.scheduler.block_manager import BlockManager
    from conveyor.stages.scheduler.sequence import Sequence

# The most blocks a plan loads for sequences that start in it; its first pass waits for them. 64
# of Llama-3-8B's 2 MiB blocks take 2.6 ms over PCIe 5.0 (ASSUMED ~51 GB/s, as the emulated
# device charges), under half of its ~6.6 ms step: the sequence gains the rest of a step, and
# each other row of that pass loses at most that once. A bigger load goes one step ahead, where
# it overlaps a pass. A block count stands in for time: the scheduler knows neither the link
# nor the step, and a bigger model's blocks grow more slowly than its step.
LOAD_NOW_BLOCKS = 64


class KvTiers:
    """The books over `blocks`: `num_host_slots` of host tier, `warm` in them at start-up, and
    `num_disk_blocks` of disk tier (0: none) holding `on_disk` at start-up, read by `num_ranks`
    ranks; up to `max_load_now` blocks a plan loaded for sequences that start in it."""

    def __init__(
        self,
        blocks: BlockManager,
        num_host_slots: int,
        warm: Iterable[tuple[int, int]] = (),
        num_disk_blocks: int = 0,
        on_disk: Iterable[int] = (),
        num_ranks: int = 1,
        max_load_now: int = LOAD_NOW_BLOCKS,
    ) -> None:
        self.blocks = blocks
        self.max_load_now = max_load_now
        self.host = HostSlots(num_host_slots, warm)
        self.disk = DiskBooks(self.host, num_disk_blocks, on_disk, num_ranks) if num_disk_blocks else None
        self.holds = PrefixHolds(blocks)  # prefixes read from disk past the host tier's size, on the device meanwhile
        blocks.newly_named = []  # the block manager now lists each block it names (take_named)
        self.saves: list[tuple[int, int, int]] = []  # this plan's (device block, host slot, name)
        self.loads: list[tuple[int, int]] = []  # this plan's (host slot, device block)
        self._loaded: list[tuple[int, int]] = []  # (device block, name) loaded by the plan before, to name now
        self._num_loaded_now = 0  # blocks this plan loads for sequences that start in it
        self._prefetch_step: dict[int, int] = {}  # seq_id -> the step that loaded its blocks
        # Swap preemption (--preemption-mode swap): a preempted sequence's blocks in slots out of the
        # LRU, then loaded back into held device blocks (and room for its next token) the step before it runs again.
        self._swapped: dict[int, list[int]] = {}  # seq_id -> its host slots
        self._swapping_in: dict[int, list[int]] = {}  # seq_id -> the device blocks loaded back for it
        self._loaded_at: dict[int, int] = {}  # seq_id -> the scheduling round that loaded them back
        self._round = 0  # begin_step calls: a round that plans nothing counts too (steps would not advance)
        self._reading: set[int] = set()  # slots this plan's loads read: no save may take them
        self._read: list[int] = []  # swap slots the plan before read back: free from this step on
        self.num_swapped_out = 0  # blocks
        self.num_host_hits = 0  # blocks loaded back from the host tier (each a device miss it saved; disk hits apart)
        self.num_saved = 0
        self.num_loaded = 0

    @property
    def fetches(self) -> list[tuple[int, int]]:
        """This plan's reads from disk: (block name, host slot)."""
        return self.disk.fetches if self.disk is not None else []

    @property
    def holding(self) -> bool:
        """Whether loaded blocks wait for the next step to join the prefix cache (free, or held)."""
        return bool(self._loaded) or self.holds.landing

    def held_blocks(self) -> list[int]:
        """The device blocks the tier holds (one reference each): loaded, not yet named, loaded
        back for a swapped-out sequence that has not run again yet, or held for a waiting
        sequence's prefix (kv_holds.py)."""
        swapping_in = [b for table in self._swapping_in.values() for b in table]
        return [block for block, _ in self._loaded] + swapping_in + self.holds.held_blocks()

    def release_holds(self) -> bool:
        """Some sequence found no room in the pool: the prefixes held for waiting sequences go
        free (kv_holds.py); whether any was held."""
        return self.holds.release_all()

    def begin_step(self, step: int) -> None:
        """Before plan `step` is built: the blocks the plan before loaded join the prefix cache
        (free, so the waiting sequence that asked for them finds them as hits), and this plan's
        saves are the blocks named since the plan before was built."""
        self.saves, self.loads, self._reading, self._num_loaded_now = [], [], set(), 0
        if self.disk is not None:
            self.disk.begin_step()
        self._round += 1
        blocks = self.blocks
        for seq_id, at in list(self._loaded_at.items()):
            if at < self._round - 1:  # not run in the round after its load (another sequence went first):
                del self._loaded_at[seq_id]  # its held blocks go back, lest they keep that one out, and it computes again
                if (table := self._swapping_in.pop(seq_id, None)) is not None:  # else it ran
                    blocks.free(table)
        self.holds.begin_step()
        if self._loaded:
            for block, name in self._loaded:
                blocks.register(block, name)  # unless an identical block was named meanwhile
            blocks.free([block for block, _ in self._loaded])
            self._loaded = []
        self.host.release(self._read)
        self._read = []
        saves: dict[int, tuple[int, int, int]] = {}  # by slot: more names than slots evict this plan's own
        for block, name in blocks.take_named():
            slot = self.host.store(name)
            if slot is not None:
                saves[slot] = (block, slot, name)
        self.saves = list(saves.values())
        if self.disk is not None:  # the worker writes them through
            for _, _, name in self.saves:
                self.disk.index.add(name)
        self.num_saved += len(self.saves)
        self._prefetch_step = {seq_id: s for seq_id, s in self._prefetch_step.items() if s >= step - 1}

    def prefetch(self, seq: Sequence, hits: list[int], step: int, starts: Callable[[int], bool]) -> list[int] | None:
        """The prefix to start `seq` with in this plan: its device `hits`, then the blocks past
        them that the host tier holds, if any, loaded into fresh device blocks (leaving a block
        for the rest of its prompt). Those are named in the prefix cache at once and free, to be
        shared as hits, when they fit this plan's `max_load_now` and `starts(prefix blocks)`
        says the sequence starts in this plan with them. None when it waits instead: for blocks
        loaded for the next plan (held until then; admitted as device hits), or read from disk.
        A sequence whose load was lost meanwhile (the pool evicted the loaded blocks) is not
        loaded twice in a row: it computes them. A hit on disk longer than the host tier's
        slots is read a part at a time, each part loaded into blocks held for the sequence
        (kv_holds.py) before the next is read into the slots that frees."""
        prefix = self._prefetch(seq, hits, step, starts)
        if prefix is not None:  # it starts with them, if it can: the caller shares them, nothing allocated in between
            self.holds.forget(seq.seq_id)
        return prefix

    def _prefetch(self, seq: Sequence, hits: list[int], step: int, starts: Callable[[int], bool]) -> list[int] | None:
        blocks = self.blocks
        limit = blocks.prefix_blocks(seq)
        if len(hits) >= limit or self._prefetch_step.get(seq.seq_id, -2) >= step - 1:
            return hits
        names = seq.full_block_hashes(blocks.block_size, limit)[len(hits) :]
        if self.disk is not None and self.disk.fetch(seq.seq_id, names, self._reading | {s for _, s, _ in self.saves}):
            return None  # reads from disk: it waits, set aside (`reading`)
        slots = self.host.lookup(names)
        # Room for all of it and a block more, or nothing: loading into a pool the running
        # sequences have filled starves their decodes (measured: a partial load there cut the
        # multi-turn race's tokens/s tenfold through preemptions).
        if not slots or not blocks.can_allocate(len(slots) + 1 + blocks.num_revived(hits)):
            return hits
        # The host tier holds the prefix this far, and the disk more that it had no slot to read
        # into (DiskBooks.fetch): what it holds goes to blocks held for the sequence, freeing
        # those slots for the next part.
        more = len(slots) < len(names) and self.disk is not None and self.disk.can_read(seq.seq_id, names[len(slots)])
        more = more and self.holds.may_hold(seq.seq_id, len(hits))
        names = names[: len(slots)]
        blocks.share(hits)  # held while the fresh blocks are taken, so that none of them is evicted
        fresh = blocks.allocate(len(slots))
        self.loads += zip(slots, fresh)
        self._reading.update(slots)
        num_read = self.disk.loaded(names) if self.disk is not None else 0
        self.num_host_hits += len(slots) - num_read
        self.num_loaded += len(slots)
        if more:
            self.holds.hold(seq.seq_id, hits, fresh, names)  # the reference just taken on `hits` is the hold's
            return None
        blocks.free(hits)
        self._prefetch_step[seq.seq_id] = step
        if self._num_loaded_now + len(fresh) <= self.max_load_now and starts(len(hits) + len(fresh)):
            self._num_loaded_now += len(fresh)
            for block, name in zip(fresh, names):
                blocks.register(block, name)  # unless an identical block was named meanwhile
            blocks.free(fresh)  # the caller shares them with `hits`: nothing is allocated in between
            return hits + fresh
        self._loaded += zip(fresh, names)
        return None

    def reading(self, seq: Sequence) -> bool:
        """Whether a waiting sequence waits for blocks of its prefix on their way from disk (it
        is set aside meanwhile, and the sequences behind it go first)."""
        return self.disk is not None and self.disk.reading(seq.seq_id)

    @property
    def only_reading(self) -> bool:
        """Whether reads from disk are in flight and nothing else of the tiers' waits for the
        next plan: with no row planned, nothing changes before a read is answered or the wait
        of the sequence asking for it ends (DiskBooks.wake_in)."""
        return self.disk is not None and bool(self.disk.reads) and not self.loads

    # --- swap preemption ------------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> bool:
        """Copy a sequence being preempted to host slots (before its blocks are released): the
        blocks of its known tokens but the last, which computes again when it resumes (its logits
        draw the next token). False, and nothing done, when the tier has no room for it."""
        keep = min(seq.num_computed_tokens, len(seq.token_ids) - 1)  # draws in flight are dropped
        num = -(-keep // self.blocks.block_size)
        slots = self.host.reserve(num, self._reading | {slot for _, slot, _ in self.saves}) if num else None
        if slots is None:
            return False
        self.saves += [(block, slot, NO_NAME) for block, slot in zip(seq.block_ids, slots)]
        self._swapped[seq.seq_id] = slots
        seq.num_swapped_tokens = keep
        self.num_swapped_out += num
        return True

    def resume(self, seq: Sequence, idle: bool = False) -> bool | None:
        """A waiting sequence's swapped-out blocks: None if it has none (it computes as any);
        True while they are on their way (loaded back by this plan into blocks held for it, or
        the pool has no room yet: it waits); False once they are back: its table and computed
        count are restored, and it runs from there. Room for its next token is held with the
        blocks it is loaded back into, so that the sequences admitted behind it meanwhile cannot
        take it: it runs at the next plan unless the budget or the seats run out before its
        turn. Blocks loaded back are held one scheduling round: a sequence not run in the round
        after its load (the queue's head went first) is recomputed, so that held blocks never
        keep the head out of the pool; nor is one whose blocks find no room while nothing runs
        (`idle`) that could free it."""
        table = self._swapping_in.pop(seq.seq_id, None)
        if table is not None:  # its round of grace stays counted (_loaded_at), should hold_again take them back
            seq.block_ids, seq.num_computed_tokens = table, seq.num_swapped_tokens
            return False
        slots = self._swapped.get(seq.seq_id)
        if slots is None:
            return None
        # Its blocks, and one more where the last is full: room for its next token, held. Room
        # only checked was taken by a sequence admitted behind it in this plan, its blocks went
        # back after their round, and two such sequences took turns for ever.
        num = self.blocks.blocks_needed(seq.num_swapped_tokens + 1, 0)
        room = self.blocks.can_allocate(num) or (self.release_holds() and self.blocks.can_allocate(num))
        if idle and not room:  # nothing runs to free room: compute it again
            self.host.release(self._swapped.pop(seq.seq_id))
            return None
        if room:
            fresh = self.blocks.allocate(num)
            self.loads += zip(slots, fresh)  # the block past its slots, if any, is the room held for its next token
            self._reading.update(slots)
            self._read += self._swapped.pop(seq.seq_id)
            self._swapping_in[seq.seq_id] = fresh
            self._loaded_at[seq.seq_id] = self._round
        return True

    def loading_back(self, seq: Sequence) -> bool:
        """Whether a swapped-out sequence's blocks are held for it, loaded back: by this plan (then
        `resume` said True: it runs at the next, set aside meanwhile) or by the one before."""
        return seq.seq_id in self._swapping_in

    def release_loaded_back(self) -> bool:
        """A running sequence found no room in the pool: the blocks loaded back by an earlier plan
        for swapped-out sequences that have not run yet go free, as held prefixes do (those
        sequences compute again); whether any did. Those this plan loads stay out until it ran."""
        released = False
        for seq_id, at in list(self._loaded_at.items()):
            if at < self._round and (table := self._swapping_in.pop(seq_id, None)) is not None:
                del self._loaded_at[seq_id]
                self.blocks.free(table)
                released = True
        return released

    def hold_again(self, seq: Sequence) -> None:
        """A sequence `resume` gave its table back to that could not run this step after all:
        the tier holds its blocks again until it does."""
        self._swapping_in[seq.seq_id] = seq.block_ids  # until the round after its load, no longer:
        self._loaded_at.setdefault(seq.seq_id, self._round)  # a later round's hold would keep the head out for good
        seq.block_ids, seq.num_computed_tokens = [], 0

    def forget(self, seq: Sequence) -> None:
        """A sequence that ends while swapped out, or waiting for reads: its slots and held
        blocks go back (reads in flight go on: their slots are freed or kept when answered)."""
        if self.disk is not None:
            self.disk.forget(seq.seq_id)
        self.holds.forget(seq.seq_id)
        if (slots := self._swapped.pop(seq.seq_id, None)) is not None:
            self.host.release(slots)
        self._loaded_at.pop(seq.seq_id, None)
        if (table := self._swapping_in.pop(seq.seq_id, None)) is not None:
            self.blocks.free(table)
