"""The KV tiers beyond the device as the step meets them (a StepFeature, --kv-offloading-size and
--kv-disk-dir): the plan's saves (device blocks to host slots) and loads (host slots to device
blocks) applied before its passes, saves first, by gpu/kv/host_tier.py; each saved block written
through to disk (gpu/kv/disk_tier.py), and at start-up the most recently used blocks on disk read
back into the host slots, before the worker reports ready. On a hit beyond the host tier the
plan's reads (`kv_fetches`) fill host slots from disk on a thread of their own
(gpu/kv/disk_reads.py), and `take_fetched` gives their answers for the scheduler (KvFetched);
`take_disk_news` gives the blocks other daemons sharing the directory wrote or removed, as the disk
tier's looks find them (KvDiskChanged). The scheduler decides what moves
(stages/scheduler/kv_tiers.py); this moves the bytes.

Ordering, on CUDA where the copies run on a side stream behind the passes queued before them: a
plan's saves read blocks its passes may rewrite (a freed block handed out again), so its first
pass waits for them. Its loads come in two batches, after the saves: those into blocks some row
of the plan names (a host hit that starts in the plan that loads it) first, and its first pass
waits for them; then the rest, into blocks the scheduler holds for the next plan, whose first
pass waits for them, so that copy overlaps this plan's passes. A save's bytes go to disk at the
next plan, once it is done. On a CPU every copy is done when the call returns.

The platform moves the bytes (`host_tier`): on the emulated device nothing moves, and each batch
of copies is time on its host link at the device's bandwidth (gpu/emulated/host_link.py), which
the passes wait for as above.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

import torch

from conveyor.gpu.kv.disk_format import HEADER, KVValidity, model_identity
from conveyor.gpu.kv.disk_reads import DiskReads
from conveyor.gpu.kv.disk_tier import GIB, DiskTier
from conveyor.gpu.kv.host_tier import KVCopies, Transfer, num_host_slots
from conveyor.gpu.step.features.base import StepFeature
from conveyor.wire.messages import KvDiskChanged, KvFetched
from conveyor.wire.step import NO_NAME

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig
    from conveyor.gpu.backends import AttentionBackend
    from conveyor.gpu.parallel.group import TensorParallel
    from conveyor.gpu.step.passes import PassWork
    from conveyor.gpu.step.platform import Platform
    from conveyor.wire.messages import StepPlan

log = logging.getLogger(__name__)


class KvOffloadStep(StepFeature):
    def __init__(self, config: EngineConfig, attn: AttentionBackend, tp: TensorParallel, platform: Platform) -> None:
        cache = config.cache
        self.platform = platform  # how the bytes move: host_tier (real copies, or the emulated link's time)
        self.rank = tp.rank
        self.block_bytes = attn.bytes_per_block(cache.block_size)
        self.num_slots = num_host_slots(cache.kv_offloading_size, self.block_bytes) if self.block_bytes else 0
        self.host: KVCopies | None = None
        self.disk: DiskTier | None = None
        self.reads: DiskReads | None = None  # reads from disk on a hit (None: no disk tier)
        self.num_disk_blocks = 0  # blocks --kv-disk-size holds
        self._refused: list[tuple[int, int, bool]] = []  # reads answered as misses at once (a slot out of range)
        self._loads: list[Transfer] = []  # loads that may still read their slots: a read into one waits for them
        self.warm: list[tuple[int, int]] = []  # (block name, host slot) read from disk at start-up, oldest first
        self._pool: torch.Tensor | None = None  # the host slots' memory until the device pool exists
        self._before_pass: list[Transfer] = []  # what the next pass must wait for
        self._next_plan: list[Transfer] = []  # this plan's loads: the next plan's first pass waits
        self._to_disk: list[tuple[Transfer, list[tuple[int, int]]]] = []  # saves in flight: (slot, name) each
        # Loads whose time is not taken yet (take_load_seconds: the worker's metrics); bounded, as
        # an in-process engine (LLM) never takes them.
        self._timed: collections.deque[Transfer] = collections.deque(maxlen=1024)
        self.num_saved = 0  # blocks copied each way (by this rank)
        self.num_loaded = 0
        if cache.kv_disk_dir is not None and self.num_slots:
            validity = KVValidity(
                model_identity(config.model), str(attn.kv_dtype), cache.block_size, type(attn).__name__, tp.rank, tp.size
            )
            capacity = int(cache.kv_disk_size * GIB)
            self.disk = DiskTier(
                cache.kv_disk_dir,
                validity=validity,
                payload_bytes=self.block_bytes,
                capacity_bytes=capacity,
                discover_s=cache.kv_disk_scan_s,
            )
            self.num_disk_blocks = capacity // (HEADER.size + self.block_bytes)
            self._warm_up()
            self.reads = DiskReads(self.disk)

    def _warm_up(self) -> None:
        """Read the most recently used blocks on disk into the host slots (each checked: a bad
        file is a miss and its slot stays free)."""
        assert self.disk is not None
        self._pool = torch.empty((self.num_slots, self.block_bytes), dtype=torch.uint8)
        for name in self.disk.hashes()[-self.num_slots :]:
            slot = len(self.warm)
            if self.disk.read_into(name, self._pool[slot].numpy().data):
                self.warm.append((name, slot))
        log.info("KV disk tier: %d blocks read back into the host tier at start-up", len(self.warm))

    def allocate(self, num_blocks: int, kv_caches: list[torch.Tensor]) -> None:
        if self.num_slots:
            self.host = self.platform.host_tier(kv_caches, self.num_slots, self.block_bytes, self._pool)
        self._pool = None

    def apply(self, plan: StepPlan) -> None:
        self._before_pass += self._next_plan
        self._next_plan = []
        if self.host is None:
            return
        self._write_through()
        if plan.kv_saves:
            blocks, slots, names = zip(*plan.kv_saves)
            transfer = self.host.save(blocks, slots)
            self._before_pass.append(transfer)
            if self.disk is not None:
                self._to_disk.append((transfer, list(zip(slots, names))))
            self.num_saved += len(blocks)
        if plan.kv_loads:
            # The blocks the rows add to their tables: a sequence starting after blocks loaded for it names them all.
            read = {b for row in plan.scheduled for b in row.new_block_ids}
            now = [(slot, block) for slot, block in plan.kv_loads if block in read]
            later = [(slot, block) for slot, block in plan.kv_loads if block not in read]
            for pairs, waits in ((now, self._before_pass), (later, self._next_plan)):
                if pairs:
                    slots, blocks = zip(*pairs)
                    load = self.host.load(slots, blocks)
                    waits.append(load)
                    self._timed.append(load)
                    self._loads.append(load)
                    self.num_loaded += len(blocks)
        if plan.kv_fetches:
            self._fetch(plan.kv_fetches)

    def _fetch(self, fetches: list[tuple[int, int]]) -> None:
        """Read blocks from disk into host slots (the scheduler took them out of its books), on
        the reader thread, once the loads that may be reading those slots are done."""
        assert self.host is not None
        self._loads = [t for t in self._loads if not t.ready()]
        reads = []
        for name, slot in fetches:
            if self.reads is None or not 0 <= slot < self.num_slots:
                self._refused.append((name, slot, False))
            else:
                reads.append((name, slot, self.host.block_bytes(slot)))
        if self.reads is not None:
            self.reads.submit(reads, self._loads)

    @property
    def reading(self) -> bool:
        """Whether reads from disk wait to be answered (`take_fetched`)."""
        return bool(self._refused) or (self.reads is not None and self.reads.pending)

    def take_fetched(self) -> KvFetched | None:
        """This rank's answers to the reads finished since the last call; None: none."""
        done, self._refused = self._refused + (self.reads.take() if self.reads is not None else []), []
        if not done:
            return None
        return KvFetched(self.rank, [(n, s) for n, s, ok in done if ok], [(n, s) for n, s, ok in done if not ok])

    def wait_fetched(self, timeout_s: float) -> None:
        """Block until a read is answered (or `timeout_s` passed, or none is in flight)."""
        if self.reads is not None and not self._refused:
            self.reads.wait(timeout_s)

    def take_disk_news(self) -> KvDiskChanged | None:
        """The blocks other daemons wrote into the disk directory and those any removed, found
        since the last call; None: none."""
        if self.disk is None:
            return None
        came, went = self.disk.take_news()
        return KvDiskChanged(self.rank, came, went) if came or went else None

    @property
    def disk_news_ms(self) -> int | None:
        """How often the disk tier looks for other daemons' blocks (None: never), and so how often
        a worker with nothing else to do should take its news."""
        return max(1, int(self.disk.discover_s * 1000)) if self.disk is not None and self.disk.discover_s > 0 else None

    def disk_names(self) -> list[int]:
        """The block names on disk for this rank, least recently used first (WorkerReady.kv_disk)."""
        return self.disk.hashes() if self.disk is not None else []

    def begin_pass(self, work: PassWork) -> None:
        for transfer in self._before_pass:
            transfer.wait_on_stream()
        self._before_pass = []

    def _write_through(self) -> None:
        """The saves before this plan's, to disk (queued: the writer thread writes them), before
        this plan's saves may reuse their slots."""
        assert self.host is not None
        for transfer, saved in self._to_disk:
            transfer.wait()
            for slot, name in saved:
                if name != NO_NAME:  # a swapped-out sequence's block: nothing to keep
                    assert self.disk is not None
                    self.disk.put(name, self.host.block_bytes(slot))
        self._to_disk = []

    def take_load_seconds(self) -> list[float]:
        """How long each load batch done since the last call took (the worker's histogram)."""
        times = [(t, t.seconds()) for t in self._timed]
        self._timed = collections.deque((t for t, s in times if s is None), maxlen=self._timed.maxlen)
        return [s for _, s in times if s is not None]

    def flush(self) -> None:
        """Everything saved so far on disk (tests, shutdown)."""
        if self.host is not None and self.disk is not None:
            self._write_through()
            self.disk.flush()
