"""The KV disk tier as the scheduler keeps its books (--kv-disk-dir): which block names the
workers' disk directories hold, and the reads from them under way into host slots. kv_tiers.py
decides what to read; the worker reads it (gpu/step/features/kv_offload.py) and answers each read
with KvFetched. Pure Python: no torch, no zmq.

- The index starts as the names every rank found on its disk at start-up (WorkerReady.kv_disk)
  and grows by each named save, which the worker writes through to disk; past the disk's size
  it forgets the least recently used name, as the worker's disk tier deletes that file. Another
  daemon sharing the directory writes and evicts too: each rank's looks report what came and
  went (KvDiskChanged); a name that came joins once every rank has reported it (each holds its
  own shard: DiskArrivals), and a name gone from any rank leaves. The index may still name a file
  that is gone (a dropped write, an eviction not seen yet, a corrupt file): a read of it fails,
  the name leaves the index, and its blocks are computed again.
- A read goes into a host slot taken out of the host tier's books, and the slot stays out until
  every rank has answered (a rank still reading writes into it). Only then do the bytes count:
  read by every rank, the slot joins the host tier under the name (a hit like any saved block);
  missed by any, the slot is free again.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.stages.scheduler.kv_host import HostSlots
    from conveyor.wire.messages import KvDiskChanged, KvFetched

# The longest a waiting sequence waits for its blocks to come from disk; then it computes them.
# A bound for a read that hangs (a dead network mount), far past a healthy one: ASSUMED, not measured.
FETCH_WAIT_S = 10.0


class DiskBooks:
    """The disk tier's books beside the host tier's `host`: the index (`capacity` blocks, holding
    `names` at start-up), the reads in flight (each answered by `num_ranks` ranks), and which
    waiting sequence waits for which."""

    def __init__(
        self, host: HostSlots, capacity: int, names: Iterable[int], num_ranks: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.host = host
        self.index = DiskIndex(capacity, names)
        self.reads = DiskReads(num_ranks)
        self.arrivals = DiskArrivals(num_ranks, capacity)
        self.clock = clock
        self.fetches: list[tuple[int, int]] = []  # this plan's (name, host slot) reads
        self._waits: dict[int, Wait] = {}  # by seq_id: sequences that waited for reads, until they end
        self._from_disk: set[int] = set()  # names read into host slots and not loaded yet: disk hits when they are
        self.num_hits = 0  # blocks loaded to the device that the host tier held because they were read for it
        self.num_misses = 0  # reads that failed on some rank (no such file, or a bad one)

    def begin_step(self) -> None:
        self.fetches = []
        if len(self._from_disk) > self.host.num_slots:  # forget those evicted before a load asked for them
            self._from_disk = {name for name in self._from_disk if name in self.host}

    def fetch(self, seq_id: int, names: list[int], keep: set[int]) -> bool:
        """Read the blocks of `names` (a waiting sequence's prefix past its device hits) that the
        disk holds and the host tier does not, up to the first block neither holds, into host
        slots (free, or the least recently used names' but those of this prefix and those in
        `keep`: this plan's loads and saves touch them); True while it waits for some, read by
        this plan or on their way already. A sequence waits at most FETCH_WAIT_S, and has a
        block read once: one the host tier evicted again before it was loaded (other reads and
        saves took its slot) is computed, so that two sequences never take turns evicting each
        other's reads."""
        now = self.clock()
        wait = self._waits.get(seq_id) or Wait(now + FETCH_WAIT_S)
        if now >= wait.until:  # waited long enough: it computes what has not come
            return False
        keep = set(keep)
        waited: list[int] = []
        wanted: list[int] = []
        for name in names:
            if (slot := self.host.slot(name)) is not None:
                keep.add(slot)
            elif name in self.reads:
                waited.append(name)
            elif name in self.index and name not in wait.read:
                wanted.append(name)
            else:
                break
        slots = (self.host.reserve(len(wanted), keep, fewer=True) or []) if wanted else []
        for name, slot in zip(wanted, slots):
            self.reads.start(name, slot)
            self.fetches.append((name, slot))
            self.index.add(name)
            wait.read.add(name)
        waited += wanted[: len(slots)]
        if not waited:
            return False
        wait.names = waited
        self._waits[seq_id] = wait
        return True

    def can_read(self, seq_id: int, name: int) -> bool:
        """Whether `fetch` would read the block for the sequence, given a free host slot: on disk,
        not on its way, not read for it before, and its wait not over."""
        wait = self._waits.get(seq_id)
        if wait is not None and (self.clock() >= wait.until or name in wait.read):
            return False
        return name in self.index and name not in self.reads

    def reading(self, seq_id: int) -> bool:
        """Whether the sequence waits for reads still in flight (and not past its wait)."""
        wait = self._waits.get(seq_id)
        return wait is not None and self.clock() < wait.until and any(name in self.reads for name in wait.names)

    def fetched(self, msg: KvFetched) -> None:
        """A rank's answers: once every rank has answered for a block, its slot joins the host
        tier (every rank read it) or is free again (a miss: the name leaves the index)."""
        for read, answers in ((True, msg.fetched), (False, msg.missed)):
            for name, slot in answers:
                done = self.reads.answer(msg.rank, name, slot, read)
                if done is None:
                    continue
                if done[1]:
                    self.host.adopt(name, slot)
                    self._from_disk.add(name)
                else:
                    self.host.release([slot])
                    self.index.discard(name)
                    self.num_misses += 1

    def changed(self, msg: KvDiskChanged) -> None:
        """A rank's news of its disk directory: names another daemon wrote (on disk once every
        rank has reported them), and names gone (from any rank: the block is gone)."""
        for name in msg.went:
            self.arrivals.discard(msg.rank, name)
            self.index.discard(name)
        for name in self.arrivals.add(msg.rank, msg.came):
            self.index.add(name)

    def loaded(self, names: list[int]) -> int:
        """The host tier loads `names` (for a waiting sequence): how many of them were read from disk
        (disk hits)."""
        num = sum(1 for name in names if name in self._from_disk)
        self._from_disk.difference_update(names)
        self.num_hits += num
        return num

    def forget(self, seq_id: int) -> None:
        """The sequence ended (its reads go on: their slots are kept or freed when answered)."""
        self._waits.pop(seq_id, None)

    def wake_in(self) -> float | None:
        """Seconds until the first sequence waiting for reads stops waiting; None: none waits."""
        now = self.clock()
        left = [w.until - now for w in self._waits.values() if w.until > now and any(n in self.reads for n in w.names)]
        return min(left) if left else None


@dataclasses.dataclass(slots=True)
class Wait:
    """A sequence's wait for reads: until when, the names read for it (each once), and the names
    in flight it waits for now."""

    until: float
    read: set[int] = dataclasses.field(default_factory=set)
    names: list[int] = dataclasses.field(default_factory=list)


class DiskIndex:
    """The block names on disk as far as the scheduler knows, least recently used first, at most
    `capacity` of them."""

    def __init__(self, capacity: int, names: Iterable[int] = ()) -> None:
        self.capacity = capacity
        self._names: OrderedDict[int, None] = OrderedDict.fromkeys(names)
        self._trim()

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: int) -> bool:
        return name in self._names

    def add(self, name: int) -> None:
        """A block written (or read) now: the most recently used."""
        self._names[name] = None
        self._names.move_to_end(name)
        self._trim()

    def discard(self, name: int) -> None:
        self._names.pop(name, None)

    def _trim(self) -> None:
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)


class DiskArrivals:
    """Names some ranks reported on their disk and others not yet (a name is on disk once all
    `num_ranks` have it), at most `capacity` of them (the disk's blocks): past it the oldest are
    forgotten, as a rank whose shard of a block was never written (a dropped write) never reports it."""

    def __init__(self, num_ranks: int, capacity: int) -> None:
        self.num_ranks = num_ranks
        self.capacity = capacity
        self._ranks: OrderedDict[int, set[int]] = OrderedDict()  # name -> the ranks that reported it

    def __len__(self) -> int:
        return len(self._ranks)

    def add(self, rank: int, names: list[int]) -> list[int]:
        """Rank `rank` has these blocks on disk: those every rank has now reported, in order. The
        bound applies once all are counted, so that a rank behind the others completes names
        before its own older ones could push them out."""
        if self.num_ranks == 1:
            return names
        done = []
        for name in names:
            ranks = self._ranks.setdefault(name, set())
            ranks.add(rank)
            if len(ranks) == self.num_ranks:
                del self._ranks[name]
                done.append(name)
        while len(self._ranks) > self.capacity:
            self._ranks.popitem(last=False)
        return done

    def discard(self, rank: int, name: int) -> None:
        """Rank `rank`'s shard of the block is gone (until it reports it again)."""
        if (ranks := self._ranks.get(name)) is not None:
            ranks.discard(rank)
            if not ranks:
                del self._ranks[name]


class DiskReads:
    """Reads in flight: name -> its host slot, until each of `num_ranks` ranks has answered."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._slot_of: dict[int, int] = {}
        self._answers: dict[int, tuple[set[int], bool]] = {}  # name -> (ranks that answered, all read it)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: int) -> bool:
        return name in self._slot_of

    def start(self, name: int, slot: int) -> None:
        self._slot_of[name] = slot
        self._answers[name] = (set(), True)

    def answer(self, rank: int, name: int, slot: int, read: bool) -> tuple[int, bool] | None:
        """Rank `rank`'s answer for the read of `name` into `slot`: (the slot, whether every rank
        read it) once this was the last rank to answer; None before, or for an answer to no
        read in flight (a rank's second answer)."""
        if self._slot_of.get(name) != slot:
            return None
        ranks, ok = self._answers[name]
        if rank in ranks:
            return None
        ranks.add(rank)
        self._answers[name] = ranks, ok and read
        if len(ranks) < self.num_ranks:
            return None
        del self._slot_of[name], self._answers[name]
        return slot, ok and read
