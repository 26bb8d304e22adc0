"""The block files of a --kv-disk-dir as one daemon's disk tier knows them (torch-free): each
file's size and last use, least recently used first, and their bytes against the size cap. The
store over it (disk_tier.py) reads and writes the files; this keeps the ledger and evicts.

- The ledger covers the whole directory, other validity keys' and other daemons' files included
  (a scan at start-up and every rescan_s, and what the tier's looks find), so the cap holds for
  the directory, not for this daemon's writes alone.
- Eviction deletes least recently used files until the bytes fit the cap. A file whose mtime moved
  since it was counted (another daemon read it: a hit `utime`s its file) goes back to the recent
  end instead; a file gone already (another daemon evicted it) just leaves the ledger.

Invariant: `stats.used_bytes` is the sum of the ledger's sizes; `lock` guards both (the writer
thread and the worker's reads share the ledger).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path

from conveyor.gpu.kv.disk_dir import scan_blocks
from conveyor.gpu.kv.disk_format import file_name

Item = tuple[str, int]  # (validity key, block hash)


@dataclasses.dataclass
class DiskTierStats:
    """Counters since start-up (for /metrics); used_bytes is what the directory holds now."""

    hits: int = 0
    misses: int = 0
    bad_files: int = 0
    writes: int = 0
    dropped_writes: int = 0  # queue full, or writes stopped after a failure
    failed_writes: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    used_bytes: int = 0


@dataclasses.dataclass
class _File:
    size: int
    used_at: float  # mtime: the last write or hit, by any daemon


class DiskFiles:
    """The files under `root`, at most `capacity_bytes` of them, counted in `stats`."""

    def __init__(self, root: Path, capacity_bytes: int, stats: DiskTierStats) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self.lock = threading.Lock()
        self._files: collections.OrderedDict[Item, _File] = collections.OrderedDict()

    def __contains__(self, item: Item) -> bool:
        """(Under the lock.)"""
        return item in self._files

    def hashes(self, key: str) -> list[int]:
        """The block hashes under validity key `key`, least recently used first."""
        with self.lock:
            return [h for k, h in self._files if k == key]

    def path(self, item: Item) -> Path:
        name = file_name(item[1])
        return self.root / item[0] / name[:2] / name

    def remember(self, item: Item, size: int, used_at: float) -> None:
        """(Under the lock.) The item is on disk, most recently used."""
        old = self._files.pop(item, None)
        self.stats.used_bytes += size - (old.size if old else 0)
        self._files[item] = _File(size, used_at)

    def forget(self, item: Item) -> None:
        """(Under the lock.) The item is not on disk (a miss, or another daemon removed it)."""
        old = self._files.pop(item, None)
        if old is not None:
            self.stats.used_bytes -= old.size

    def rescan(self) -> None:
        """Count every file under the directory again: the cap counts the whole directory."""
        files = collections.OrderedDict(((f.key, f.block_hash), _File(f.size, f.used_at)) for f in scan_blocks(self.root))
        with self.lock:
            self._files = files
            self.stats.used_bytes = sum(f.size for f in files.values())

    def evict(self) -> None:
        """Delete least recently used files until the directory fits the cap. A file another
        daemon read since we last looked goes back to the recent end instead."""
        with self.lock:
            checks = len(self._files)
            while self.stats.used_bytes > self.capacity_bytes and self._files and checks > 0:
                checks -= 1
                item, entry = self._files.popitem(last=False)
                self.stats.used_bytes -= entry.size
                path = self.path(item)
                try:
                    mtime = path.stat().st_mtime
                    if mtime > entry.used_at + 1.0:
                        self.remember(item, entry.size, mtime)
                        continue
                    path.unlink()
                    self.stats.evictions += 1
                except OSError:  # gone already (another daemon evicted it)
                    pass
