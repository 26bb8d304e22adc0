"""The KV disk tier's directory (torch-free): checked at start-up, scanned for the blocks it holds,
watched for the blocks other daemons add and remove (ShardWatch), and written atomically. Layout
and file format: disk_format.py; the store over it: disk_tier.py.

Only names of our own shape are ever counted or deleted: validity keys (16 hex digits), shards
(2), block files (16 hex digits ".kv") and our temporary files; anything else a user keeps under
the directory is left alone.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from conveyor.config.errors import ConfigError
from conveyor.gpu.kv.disk_format import hash_of_name

STALE_TEMP_S = 3600.0  # a temporary file this old is a dead writer's: removed by a scan
# A shard whose mtime is this close to the clock when it was listed is listed again at the next
# look: a change in the same timestamp tick leaves its mtime as it was (ext4's tick is the
# kernel's, a few ms; FAT's is 2 s; a network mount's clock may be off by some).
RACY_NS = 2_000_000_000


def open_kv_dir(path: str | os.PathLike[str], flag: str = "--kv-disk-dir") -> Path:
    """The directory, checked at start-up: made (mode 0700: KV reveals prompts) when only its last
    component is missing, never with its parents, so that a mistyped path or an unmounted disk is
    an error and not a cache on the root file system; ConfigError naming `flag` if it is not a
    writable directory."""
    if not str(path):
        raise ConfigError(f"{flag}: an empty path")
    root = Path(path).expanduser()
    if not root.exists():
        if not root.parent.is_dir():
            raise ConfigError(f"{flag} {root}: its parent {root.parent} is not a directory")
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:  # another daemon made it meanwhile
            pass
        except OSError as e:
            raise ConfigError(f"{flag} {root}: cannot create it ({e.strerror})") from e
    if not root.is_dir():
        raise ConfigError(f"{flag} {root}: not a directory")
    probe = root / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:  # os.access says yes to root on a read-only mount; a write says what is true
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {root}: not writable ({e.strerror or e})") from e
    return root


class Found(NamedTuple):
    used_at: float  # mtime: the last write or hit, by any daemon
    key: str
    block_hash: int
    size: int


def scan_blocks(root: Path) -> list[Found]:
    """Every block file under root, least recently used first. Dead writers' temporary files go."""
    found: list[Found] = []
    now = time.time()
    for key_dir in _dirs(root, 16):
        for shard in _dirs(Path(key_dir.path), 2):
            for entry in _entries(Path(shard.path)):
                try:
                    st = entry.stat()
                    block_hash = hash_of_name(entry.name)
                    if block_hash is not None:
                        found.append(Found(st.st_mtime, key_dir.name, block_hash, st.st_size))
                    elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                        os.unlink(entry.path)
                except OSError:  # evicted or renamed by another daemon meanwhile
                    continue
    found.sort()
    return found


class ShardWatch:
    """The block names under one validity key's directory, and which came and went between two
    looks. Adding, renaming or removing a file changes its directory's mtime (POSIX) while a hit
    (utime on the file) does not, so a look stats each shard directory (at most 256) and lists
    only those whose mtime moved since their last listing, or was racy then (RACY_NS); a `full`
    look lists every shard. A shard's mtime is taken before it is listed, so a change during the
    listing shows at the next look."""

    def __init__(self, key_dir: Path) -> None:
        self.key_dir = key_dir
        self._shards: dict[str, tuple[int | None, set[int]]] = {}  # name -> (mtime_ns when listed, None: racy; its blocks)

    def look(self, full: bool = False) -> tuple[list[int], list[int]]:
        """(block hashes added, block hashes gone) since the last look; the first finds them all."""
        added: list[int] = []
        gone: list[int] = []
        shards = {entry.name: entry for entry in _dirs(self.key_dir, 2)}
        for name in self._shards.keys() - shards.keys():  # a shard removed whole
            gone += self._shards.pop(name)[1]
        for name, entry in shards.items():
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            except OSError:  # removed meanwhile: the next look says so
                continue
            seen, before = self._shards.get(name, (None, set()))
            if seen == mtime and not full:
                continue
            now = time.time_ns()
            blocks = {h for e in _entries(Path(entry.path)) if (h := hash_of_name(e.name)) is not None}
            added += blocks - before
            gone += before - blocks
            self._shards[name] = (mtime if now - mtime > RACY_NS else None, blocks)
        return added, gone


def write_atomically(path: Path, *parts: bytes | memoryview) -> None:
    """`path` := the concatenated parts, through a temporary file beside it renamed over it
    (atomic: a reader, or another writer of the same path, sees a whole file or none). No fsync:
    see disk_tier.py. Raises OSError, leaving no temporary file behind."""
    temp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _dirs(path: Path, name_length: int) -> list[os.DirEntry[str]]:
    return [e for e in _entries(path) if len(e.name) == name_length and _is_hex(e.name) and e.is_dir(follow_symlinks=False)]


def _is_hex(name: str) -> bool:
    return all(c in "0123456789abcdef" for c in name)


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []
