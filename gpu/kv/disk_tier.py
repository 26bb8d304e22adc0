"""The KV disk tier's byte store (--kv-disk-dir, --kv-disk-size): blocks as files named by their
prefix-cache hash under a validity key (disk_format.py), surviving restarts. Torch-free: it stores
bytes (a host-tier slot's, host_tier.py) and reads them back into a slot.

- `put` queues a write and returns at once; one writer thread writes each block to a temporary
  file beside its final name and renames it over (`os.replace`, atomic), so a reader, another
  daemon sharing the directory, or a crash sees a whole file or none. No fsync: this is a cache,
  and a file torn by a power cut fails its length or CRC check and reads as a miss; an fsync per
  block would cost milliseconds of the writer's time for nothing a process crash can lose. A full
  queue drops the write (the block stays recomputable): the step never waits on the disk.
- `get` / `read_into` read synchronously and check the header, length and CRC: a bad file is a
  miss, deleted, and logged once per run. A file another daemon evicted meanwhile is a miss too.
- The size cap evicts least recently used files (mtime, touched on each hit) over the whole
  directory, other keys' and other daemons' files included (disk_files.py keeps that ledger). A failed write (a full disk, a quota,
  the directory gone read-only) stops writes for `retry_after_s`, logged once; reads go on.
- `hashes` lists what is on disk, oldest first, for the scheduler's index after a restart.
- Every `discover_s` (0: never) the writer thread looks for the blocks other daemons sharing the
  directory wrote or removed since (`discover`: a stat per shard directory, a listing of those
  that changed), counts them against the cap, and keeps them as news for the scheduler's index
  (disk_news.py, `take_news`). Every `rescan_s` it lists every shard, and after a write stats every file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import threading
import time
import zlib
from pathlib import Path

from conveyor.config.errors import ConfigError
from conveyor.gpu.kv.disk_dir import open_kv_dir, write_atomically
from conveyor.gpu.kv.disk_files import DiskFiles, DiskTierStats, Item
from conveyor.gpu.kv.disk_format import HEADER, BadFile, KVValidity, check_header, encode_header
from conveyor.gpu.kv.disk_news import DiskNews

log = logging.getLogger(__name__)

GIB = 1024**3


class DiskTier:
    """Blocks of `payload_bytes` (the host tier's bytes_per_slot) under `root`, at most
    `capacity_bytes` of files. `adapter` in each call names a LoRA adapter (with a digest of its
    weights; None: the base model): its blocks live under their own validity key."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        validity: KVValidity,
        payload_bytes: int,
        capacity_bytes: int,
        max_pending: int = 64,
        retry_after_s: float = 60.0,
        rescan_s: float = 300.0,
        discover_s: float = 0.0,
    ) -> None:
        self.root = open_kv_dir(root)
        self.validity = validity
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        if capacity_bytes < self.file_bytes:
            raise ConfigError(f"--kv-disk-size {capacity_bytes / GIB:.3f} GiB holds no block of {self.file_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.retry_after_s = retry_after_s
        self.rescan_s = rescan_s
        self.discover_s = discover_s
        self.stats = DiskTierStats()
        self._keys: dict[str | None, str] = {}  # adapter -> validity key
        self._adapters: dict[str, str | None] = {}  # and back
        self._made: set[str] = set()  # keys whose directory exists
        self._closed = False
        self._logged: set[str] = set()
        self._files = DiskFiles(self.root, capacity_bytes, self.stats)
        self._lock = self._files.lock  # guards the ledger and _pending
        self._pending: dict[Item, bytes] = {}  # queued, not yet on disk: readable from here
        self._queue: queue.Queue[Item | None] = queue.Queue(maxsize=max_pending)
        self._writes_stopped_until = 0.0  # time.monotonic()
        try:  # the base model's directory now: a failure is a start-up error
            self._make_key_dir(self._key(None))
        except OSError as e:
            raise ConfigError(f"--kv-disk-dir {self.root}: cannot write in it ({e})") from e
        # The base model's blocks, those the scheduler's index names. Its first look comes before
        # the scan: a file written between the two is news as well (the index adds it twice).
        self._news = DiskNews(self.root / self._key(None), capacity_bytes // self.file_bytes)
        self._files.rescan()
        self._scanned_at = self._looked_at = self._listed_at = time.monotonic()
        self._files.evict()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- what the worker calls

    def contains(self, block_hash: int, adapter: str | None = None) -> bool:
        """Whether the block is on disk or queued, as far as this daemon knows (no disk access)."""
        item = (self._key(adapter), block_hash)
        with self._lock:
            return item in self._files or item in self._pending

    def hashes(self, adapter: str | None = None) -> list[int]:
        """The blocks on disk under this validity key, least recently used first."""
        return self._files.hashes(self._key(adapter))

    @property
    def writing(self) -> bool:
        """False for retry_after_s after a failed write."""
        return time.monotonic() >= self._writes_stopped_until

    def put(self, block_hash: int, data: bytes | memoryview, adapter: str | None = None) -> bool:
        """Queue the block for writing; False if dropped (writes stopped, or the queue is full).
        `data` is copied unless it is `bytes`, so its buffer (a host slot) may be reused at once."""
        if len(data) != self.payload_bytes:
            raise ValueError(f"a block of {len(data)} bytes, expected {self.payload_bytes}")
        item = (self._key(adapter), block_hash)
        with self._lock:
            if item in self._files or item in self._pending:
                return True
        if self._closed or not self.writing:
            self.stats.dropped_writes += 1
            return False
        payload = data if isinstance(data, bytes) else bytes(data)
        with self._lock:
            self._pending[item] = payload
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                del self._pending[item]
            self.stats.dropped_writes += 1
            return False
        return True

    def get(self, block_hash: int, adapter: str | None = None) -> bytearray | None:
        """The block's bytes, or None on a miss (absent, or a bad file, then deleted)."""
        out = bytearray(self.payload_bytes)
        return out if self.read_into(block_hash, out, adapter) else None

    def read_into(self, block_hash: int, out: bytearray | memoryview, adapter: str | None = None) -> bool:
        """Read the block into `out` (payload_bytes, writable: a host tier's block_bytes(slot));
        False on a miss, and `out` then holds nothing valid."""
        view = memoryview(out).cast("B")
        if view.readonly or len(view) != self.payload_bytes:
            raise ValueError(f"read_into needs a writable buffer of {self.payload_bytes} bytes")
        item = (self._key(adapter), block_hash)
        with self._lock:
            pending = self._pending.get(item)
        if pending is not None:
            view[:] = pending
            self.stats.hits += 1
            return True
        path = self._files.path(item)
        try:
            with open(path, "rb", buffering=0) as f:
                crc = check_header(f.read(HEADER.size), block_hash, item[0], self.payload_bytes)
                got = 0
                while got < len(view) and (n := f.readinto(view[got:])):
                    got += n
                if got != len(view):
                    raise BadFile(f"truncated payload ({got} of {len(view)} bytes)")
                if f.read(1):
                    raise BadFile("bytes past the payload")
            if zlib.crc32(view) != crc:
                raise BadFile("checksum mismatch")
        except FileNotFoundError:
            return self._miss(item)
        except BadFile as e:
            self._discard(item, path, str(e))
            return self._miss(item)
        except OSError as e:  # EIO and the like: the file may be fine later; keep it
            self._log_once("read", "KV disk tier: reading %s failed (%s): a miss", path, e)
            return self._miss(item)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU clock, seen by every daemon sharing the directory
        with self._lock:
            self._files.remember(item, self.file_bytes, time.time())
        self.stats.hits += 1
        self.stats.bytes_read += self.payload_bytes
        return True

    def take_news(self) -> tuple[list[int], list[int]]:
        """The base model's block names other daemons wrote and those any daemon removed, since
        the last call (disk_news.py): (came, went)."""
        return self._news.take()

    def discover(self, full: bool = False) -> None:
        """Look for the blocks other daemons wrote into the directory or removed from it (every
        shard listed if `full`): counted against the cap, and news for `take_news`."""
        key = self._key(None)
        self._looked_at = time.monotonic()
        if full:
            self._listed_at = self._looked_at
        found, went = self._news.look(full)
        with self._lock:
            for name in went:
                self._files.forget((key, name))
            for used_at, name, size in found:
                if (key, name) not in self._files:
                    self._files.remember((key, name), size, used_at)
        if found:
            self._files.evict()

    def flush(self) -> None:
        """Wait until every queued write is on disk or dropped."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        self._closed = True
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # -- the writer thread

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._look_in())
            except queue.Empty:  # idle: time to look for other daemons' files
                self._look()
                continue
            if item is None:
                break
            try:
                with self._lock:
                    data = self._pending.get(item)
                if data is not None and self.writing:
                    self._write(item, data)
                elif data is not None:
                    self.stats.dropped_writes += 1
            except Exception:  # a bug: the block is dropped, the writer goes on
                self.stats.failed_writes += 1
                self._log_once("bug", "KV disk tier: writing a block failed", exc_info=True)
            finally:
                with self._lock:
                    self._pending.pop(item, None)
                self._queue.task_done()
            if time.monotonic() - self._scanned_at > self.rescan_s:
                self._files.rescan()
                self._scanned_at = time.monotonic()
                self._files.evict()
            if self._look_in() == 0:
                self._look()
        self._queue.task_done()

    def _look_in(self) -> float | None:
        """Seconds until the next look for other daemons' files (None: never)."""
        return max(0.0, self._looked_at + self.discover_s - time.monotonic()) if self.discover_s > 0 else None

    def _look(self) -> None:
        try:
            self.discover(full=time.monotonic() - self._listed_at > self.rescan_s)
        except Exception:  # a bug: no news this time, the writer goes on
            self._log_once("look", "KV disk tier: looking for other daemons' blocks failed", exc_info=True)

    def _write(self, item: Item, data: bytes) -> None:
        path = self._files.path(item)
        try:
            self._make_key_dir(item[0])
            path.parent.mkdir(exist_ok=True)
            write_atomically(path, encode_header(item[1], item[0], data), data)
        except OSError as e:
            self.stats.failed_writes += 1
            self._writes_stopped_until = time.monotonic() + self.retry_after_s
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
            self._log_once("write", "KV disk tier: a write failed (%s): writes stop for %.0f s, reads go on", why, self.retry_after_s)
            return
        with self._lock:
            self._files.remember(item, self.file_bytes, time.time())
        self.stats.writes += 1
        self.stats.bytes_written += self.file_bytes
        if item[0] == self._key(None):
            self._news.wrote(item[1])
        self._files.evict()

    # -- the directory

    def _key(self, adapter: str | None) -> str:
        """The validity key of `adapter`'s blocks (its directory is made by the first write)."""
        key = self._keys.get(adapter)
        if key is None:
            key = self._keys[adapter] = self.validity.key(adapter)
            self._adapters[key] = adapter
        return key

    def _make_key_dir(self, key: str) -> None:
        """The key's directory, with a validity.json saying what it holds."""
        if key in self._made:
            return
        directory = self.root / key
        directory.mkdir(exist_ok=True)
        described = directory / "validity.json"
        if not described.exists():
            text = json.dumps(self.validity.describe(self._adapters[key]), indent=1, sort_keys=True) + "\n"
            write_atomically(described, text.encode())
        self._made.add(key)

    def _miss(self, item: Item) -> bool:
        with self._lock:
            self._files.forget(item)
        self.stats.misses += 1
        return False

    def _discard(self, item: Item, path: Path, reason: str) -> None:
        self.stats.bad_files += 1
        self._log_once("bad", "KV disk tier: %s is bad (%s): deleted, a miss (further bad files are not logged)", path, reason)
        with contextlib.suppress(OSError):
            path.unlink()

    def _log_once(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message, *args, exc_info=exc_info)
