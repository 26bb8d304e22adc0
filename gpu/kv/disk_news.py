"""News of the base model's blocks in a shared --kv-disk-dir (torch-free): the files other daemons
wrote there (data-parallel replicas, a restart racing the old process) and those any daemon
removed, found by looking (disk_dir.ShardWatch) and kept until the worker takes them for the
scheduler's index (KvDiskChanged). disk_tier.py looks on its writer thread, every discover_s.

- This daemon's own writes are not news: the scheduler named them when it saved them. Its own
  evictions are: the index then forgets a name it would otherwise read and miss.
- The last word on a name wins (written, removed, written again: one piece of news), and at most
  `max_news` names wait (the disk's blocks); past it the oldest is forgotten. A name missed is
  computed where it could have been read; a removal missed is a read that misses: both as before
  this news existed.
- A name found is given with its file's mtime and size (for the tier's cap), oldest first, so
  that an index adding them in that order keeps its least recently used first.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path

from conveyor.gpu.kv.disk_dir import ShardWatch
from conveyor.gpu.kv.disk_format import file_name

Found = tuple[float, int, int]  # (mtime, block hash, file size)


class DiskNews:
    def __init__(self, key_dir: Path, max_news: int) -> None:
        self.key_dir = key_dir
        self.max_news = max_news
        self._watch = ShardWatch(key_dir)
        self._watch.look()  # what is there now is not news
        self._lock = threading.Lock()  # the writer thread looks and records; the worker takes
        self._news: collections.OrderedDict[int, bool] = collections.OrderedDict()  # name -> on disk
        self._own: set[int] = set()  # names this daemon wrote since the last look

    def wrote(self, name: int) -> None:
        """This daemon wrote the block: not news at the next look."""
        with self._lock:
            if len(self._own) < self.max_news:  # bounded where nobody looks (then nothing clears it)
                self._own.add(name)

    def look(self, full: bool = False) -> tuple[list[Found], list[int]]:
        """Look at the directory (every shard listed if `full`): (the files that came, oldest
        first; the names that went), this daemon's writes included, and the news recorded."""
        with self._lock:  # one look at a time; `wrote` waits for it, so a write it did not list stays left out next time
            came, went = self._watch.look(full)
            found: list[Found] = []
            for name in came:
                fname = file_name(name)
                try:
                    st = (self.key_dir / fname[:2] / fname).stat()
                except OSError:  # removed again meanwhile
                    continue
                found.append((st.st_mtime, name, st.st_size))
            found.sort()
            for name in went:
                self._tell(name, False)
            for _, name, _ in found:
                if name not in self._own:
                    self._tell(name, True)
            self._own.clear()
        return found, went

    def take(self) -> tuple[list[int], list[int]]:
        """The news since the last call, each in the order found: (names that came, names that went)."""
        with self._lock:
            news, self._news = self._news, collections.OrderedDict()
        return [n for n, there in news.items() if there], [n for n, there in news.items() if not there]

    def _tell(self, name: int, there: bool) -> None:
        self._news[name] = there
        self._news.move_to_end(name)
        if len(self._news) > self.max_news:
            self._news.popitem(last=False)
