"""The KV disk tier (gpu/kv/disk_tier.py): blocks written as files come back byte for byte, after a
restart too; a changed model reads nothing; a corrupt, truncated or misplaced file is a miss logged
once; a full disk stops writes while reads go on; a bad directory is refused at start-up; the size
cap evicts the least recently used; two processes writing one directory leave only valid files, and
each finds the blocks the other wrote or removed after it started (disk_news.py), listing only the
shards whose mtime moved; reads on a hit (disk_reads.py) run on their own thread, after the copies in
flight, each answered once."""

from __future__ import annotations

import dataclasses
import errno
import logging
import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from conveyor.config.errors import ConfigError
from conveyor.gpu.kv import disk_tier as disk_tier_module
from conveyor.gpu.kv.disk_dir import RACY_NS, STALE_TEMP_S, ShardWatch
from conveyor.gpu.kv.disk_format import HEADER, KVValidity, file_name
from conveyor.gpu.kv.disk_reads import DiskReads
from conveyor.gpu.kv.disk_tier import DiskTier

PAYLOAD = 4096
FILE = HEADER.size + PAYLOAD
VALIDITY = KVValidity(model="tiny-llama@abc123", kv_dtype="bfloat16", block_size=16, layout="[2, num_blocks, block_size, Hkv, D]")
HASHES = [7, -3, 2**63 - 1, -(2**63), 123456789]  # chain_hash's values are signed 64-bit


def block(h: int, salt: int = 0) -> bytes:
    """A payload that differs for every hash (and salt)."""
    seed = (h * 2654435761 + salt) & 0xFFFFFFFF
    return bytes((seed >> (8 * (i % 4)) ^ i) & 0xFF for i in range(PAYLOAD))


def tier(root: Path, validity: KVValidity = VALIDITY, capacity_files: int = 100, **kwargs) -> DiskTier:
    return DiskTier(root, validity=validity, payload_bytes=PAYLOAD, capacity_bytes=capacity_files * FILE, **kwargs)


def written(root: Path, hashes, validity: KVValidity = VALIDITY, **kwargs) -> DiskTier:
    disk = tier(root, validity, **kwargs)
    for h in hashes:
        assert disk.put(h, block(h))
    disk.flush()
    return disk


def path_of(root: Path, h: int, adapter: str | None = None) -> Path:
    name = file_name(h)
    return root / VALIDITY.key(adapter) / name[:2] / name


def test_blocks_round_trip_under_their_validity_key(tmp_path):
    disk = written(tmp_path, HASHES)
    for h in HASHES:
        assert disk.contains(h) and disk.get(h) == block(h)
        assert path_of(tmp_path, h).stat().st_size == FILE
    assert disk.get(99) is None and not disk.contains(99)
    assert disk.stats.writes == len(HASHES) and disk.stats.hits == len(HASHES) and disk.stats.misses == 1
    described = (tmp_path / VALIDITY.key() / "validity.json").read_text()
    assert "tiny-llama@abc123" in described and '"tp_rank": 0' in described
    disk.close()


def test_read_into_fills_a_slot_in_place(tmp_path):
    disk = written(tmp_path, [5])
    slot = memoryview(bytearray(PAYLOAD))
    assert disk.read_into(5, slot) and bytes(slot) == block(5)
    assert not disk.read_into(6, slot)
    with pytest.raises(ValueError, match="writable buffer"):
        disk.read_into(5, bytes(PAYLOAD))
    with pytest.raises(ValueError, match="4096"):
        disk.put(5, b"short")
    disk.close()


def test_a_restart_finds_the_blocks_least_recently_used_first(tmp_path):
    written(tmp_path, HASHES).close()
    for age, h in enumerate(HASHES):  # the first hash used last
        t = time.time() - 100 * age
        os.utime(path_of(tmp_path, h), (t, t))
    again = tier(tmp_path)
    assert again.hashes() == HASHES[::-1]
    assert all(again.get(h) == block(h) for h in HASHES)
    assert again.stats.used_bytes == len(HASHES) * FILE
    again.close()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "tiny-llama@def456"},
        {"kv_dtype": "float8_e4m3fn"},
        {"block_size": 32},
        {"layout": "[2, num_blocks, Hkv, block_size * D]"},
        {"tp_rank": 1, "tp_size": 2},
        {"format_version": 2},
        {"hash_scheme": "cpython3.99-64bit"},
    ],
)
def test_a_changed_model_reads_nothing_stale(tmp_path, change):
    written(tmp_path, HASHES).close()
    other = tier(tmp_path, dataclasses.replace(VALIDITY, **change))
    assert other.hashes() == [] and all(other.get(h) is None for h in HASHES)
    other.close()
    assert tier(tmp_path).hashes() != []  # and the old model's blocks are still there for it


def test_an_adapter_has_its_own_key(tmp_path):
    disk = tier(tmp_path)
    assert disk.put(1, block(1, salt=1), adapter="sql-lora@9f2c") and disk.put(1, block(1))
    disk.flush()
    assert disk.get(1, adapter="sql-lora@9f2c") == block(1, salt=1) and disk.get(1) == block(1)
    assert disk.get(1, adapter="sql-lora@0000") is None
    assert disk.hashes("sql-lora@9f2c") == [1] and path_of(tmp_path, 1, "sql-lora@9f2c").exists()
    disk.close()


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0x40
    path.write_bytes(data)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: FILE - 10])


def misplace(path: Path) -> None:  # another block's file under this name
    path.write_bytes(path_of(path.parents[2], HASHES[1]).read_bytes())


def test_bad_files_are_misses_deleted_and_logged_once(tmp_path, caplog):
    disk = written(tmp_path, HASHES)
    damage = [corrupt, truncate, misplace]
    for h, hurt in zip(HASHES[2:], damage):
        hurt(path_of(tmp_path, h))
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.kv.disk_tier"):
        assert [disk.get(h) for h in HASHES[2:]] == [None] * 3
    assert disk.stats.bad_files == 3 and not any(path_of(tmp_path, h).exists() for h in HASHES[2:])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0]
    assert disk.get(HASHES[0]) == block(HASHES[0]) and not disk.contains(HASHES[2])
    disk.close()


def test_a_full_disk_stops_writes_and_reads_go_on(tmp_path, monkeypatch, caplog):
    disk = written(tmp_path, HASHES[:2])
    real_write = os.write

    def full(fd, data):
        if "kv-disk-writer" in threading.current_thread().name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.kv.disk_tier"):
        assert disk.put(50, block(50))  # queued; the write fails on the writer thread
        disk.flush()
        assert not disk.writing and not disk.put(51, block(51))
    assert [r.getMessage() for r in caplog.records] == [
        "KV disk tier: a write failed (the disk is full): writes stop for 60 s, reads go on"
    ]
    assert disk.stats.failed_writes == 1 and disk.stats.dropped_writes == 1
    assert not path_of(tmp_path, 50).exists() and not list(tmp_path.rglob("*.tmp"))
    assert disk.get(HASHES[0]) == block(HASHES[0]) and disk.get(HASHES[1]) == block(HASHES[1])
    disk.close()


def test_writes_resume_after_the_pause(tmp_path, monkeypatch):
    disk = tier(tmp_path, retry_after_s=0.0)
    monkeypatch.setattr(disk_tier_module, "write_atomically", _raise(errno.EDQUOT))
    assert disk.put(1, block(1))
    disk.flush()
    monkeypatch.undo()
    assert disk.put(2, block(2))
    disk.flush()
    assert disk.get(2) == block(2) and disk.stats.failed_writes == 1
    disk.close()


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def test_a_full_queue_drops_writes_instead_of_waiting(tmp_path, monkeypatch):
    release = threading.Event()
    real = disk_tier_module.write_atomically

    def slow(*args):
        release.wait(10)
        real(*args)

    disk = tier(tmp_path, max_pending=2)
    monkeypatch.setattr(disk_tier_module, "write_atomically", slow)
    start = time.perf_counter()
    accepted = [disk.put(h, block(h)) for h in range(6)]
    assert time.perf_counter() - start < 1.0
    assert accepted[:2] == [True, True] and accepted.count(False) >= 3 and disk.stats.dropped_writes >= 3
    assert disk.get(0) == block(0)  # queued blocks read from memory meanwhile
    release.set()
    disk.flush()
    assert sorted(disk.hashes()) == [h for h in range(6) if accepted[h]]
    disk.close()


def test_a_missing_directory_is_made_but_not_its_parents(tmp_path):
    tier(tmp_path / "kv").close()
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match=r"--kv-disk-dir .*nvme/kv: its parent .*nvme is not a directory"):
        tier(tmp_path / "nvme" / "kv")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--kv-disk-dir .*file: not a directory"):
        tier(tmp_path / "file")


def test_a_read_only_directory_is_an_error_at_start_up(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    if os.geteuid() == 0:  # root writes through mode bits: a read-only mount, then
        real_open = os.open

        def read_only(path, *args, **kwargs):
            if str(path).startswith(str(root)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match="--kv-disk-dir .*ro: not writable"):
        tier(root)
    root.chmod(0o755)


def test_the_cap_evicts_the_least_recently_used(tmp_path):
    disk = written(tmp_path, [1, 2, 3], capacity_files=3)
    assert disk.get(1) == block(1)  # 2 is now the least recently used
    assert disk.put(4, block(4))
    disk.flush()
    assert sorted(disk.hashes()) == [1, 3, 4] and not path_of(tmp_path, 2).exists()
    assert disk.stats.evictions == 1 and disk.stats.used_bytes == 3 * FILE
    disk.close()
    smaller = tier(tmp_path, capacity_files=1)  # a smaller cap at start-up evicts at once
    assert smaller.hashes() == [4] and smaller.stats.used_bytes == FILE
    smaller.close()
    with pytest.raises(ConfigError, match="--kv-disk-size"):
        DiskTier(tmp_path, validity=VALIDITY, payload_bytes=PAYLOAD, capacity_bytes=FILE - 1)


def test_a_scan_removes_dead_writers_temp_files_and_nothing_foreign(tmp_path):
    written(tmp_path, [1]).close()
    shard = path_of(tmp_path, 1).parent
    dead, live = shard / "x.kv.9.dead.tmp", shard / "y.kv.9.live.tmp"
    for f in (dead, live):
        f.write_bytes(b"partial")
    old = time.time() - 2 * STALE_TEMP_S
    os.utime(dead, (old, old))
    foreign = tmp_path / "notes" / "ab"
    foreign.mkdir(parents=True)
    (foreign / ("0" * 16 + ".kv")).write_bytes(b"x" * (10 * FILE))
    again = tier(tmp_path, capacity_files=2)
    assert not dead.exists() and live.exists() and (foreign / ("0" * 16 + ".kv")).exists()
    assert again.hashes() == [1] and again.stats.used_bytes == FILE
    again.close()


def _write_from_another_process(root: str, own: list[int], shared: list[int], barrier) -> None:
    disk = tier(Path(root), capacity_files=1000, max_pending=1000)
    barrier.wait()
    for h in shared + own:
        disk.put(h, block(h))
    disk.close()


def test_two_processes_writing_one_directory_leave_valid_files(tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    shared = list(range(100, 160))
    own = {i: list(range(i * 1000, i * 1000 + 40)) for i in (1, 2)}
    workers = [context.Process(target=_write_from_another_process, args=(str(tmp_path), own[i], shared, barrier)) for i in own]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    reader = tier(tmp_path, capacity_files=1000)
    everything = shared + own[1] + own[2]
    assert sorted(reader.hashes()) == sorted(everything)
    assert all(reader.get(h) == block(h) for h in everything) and reader.stats.bad_files == 0
    assert not list(tmp_path.rglob("*.tmp"))
    reader.close()


def test_blocks_another_daemon_writes_or_removes_after_start_up_are_news_after_a_look(tmp_path):
    ours = written(tmp_path, [1])
    theirs = tier(tmp_path)  # a second daemon on the same directory, started after ours wrote 1
    assert theirs.hashes() == [1]
    assert theirs.put(2, block(2)) and theirs.put(3, block(3)) and ours.put(4, block(4))
    theirs.flush()
    ours.flush()
    ours.discover()
    assert ours.take_news() == ([2, 3], [])  # its own write (4) is not news: the scheduler named it
    assert ours.take_news() == ([], [])  # each piece of news once
    assert ours.contains(3) and ours.stats.used_bytes == 4 * FILE  # and counted against the cap
    assert ours.get(3) == block(3)
    path_of(tmp_path, 2).unlink()  # evicted by the other daemon
    assert theirs.put(5, block(5))
    theirs.flush()
    path_of(tmp_path, 5).unlink()  # came and went between two looks: nothing to say
    ours.discover()
    assert ours.take_news() == ([], [2]) and not ours.contains(2) and ours.stats.used_bytes == 3 * FILE
    theirs.discover()
    assert theirs.take_news() == ([4], [])  # its own 2 and 5 went before it looked: nothing to say
    ours.close()
    theirs.close()


def test_another_ranks_shards_are_not_news(tmp_path):
    ours = tier(tmp_path)
    rank1 = written(tmp_path, [1], dataclasses.replace(VALIDITY, tp_rank=1, tp_size=2))
    ours.discover()
    assert ours.take_news() == ([], [])
    ours.close()
    rank1.close()


def test_the_writer_thread_looks_every_discover_s(tmp_path):
    ours = tier(tmp_path, discover_s=0.05)
    theirs = written(tmp_path, [7, 8])
    deadline = time.monotonic() + 10
    came: list[int] = []
    while len(came) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
        came += ours.take_news()[0]
    assert sorted(came) == [7, 8]
    ours.close()
    theirs.close()


def _age(shard: Path, seconds: float) -> None:
    """Set a shard directory's mtime `seconds` into the past (past the racy window)."""
    t = time.time() - seconds
    os.utime(shard, (t, t))


def test_a_look_lists_only_the_shards_whose_mtime_moved(tmp_path):
    written(tmp_path, [1, 2**56]).close()  # two shards: 00 and 01 (a name's first two hex digits)
    key_dir = tmp_path / VALIDITY.key()
    shards = sorted(p for p in key_dir.iterdir() if p.is_dir())
    for shard in shards:
        _age(shard, 10)
    watch = ShardWatch(key_dir)
    assert sorted(watch.look()[0]) == [1, 2**56] and len(shards) == 2
    hidden = path_of(tmp_path, 3)  # a file whose shard keeps its mtime: a look trusts the mtime
    mtime = hidden.parent.stat().st_mtime_ns
    hidden.write_bytes(path_of(tmp_path, 1).read_bytes())
    os.utime(hidden.parent, ns=(mtime, mtime))
    assert watch.look() == ([], [])
    assert watch.look(full=True) == ([3], [])  # a full look lists every shard
    path_of(tmp_path, 1).unlink()  # the shard's mtime moves: listed again
    assert watch.look() == ([], [1])


def test_a_shard_changed_within_the_racy_window_is_listed_again(tmp_path):
    written(tmp_path, [1]).close()
    key_dir = tmp_path / VALIDITY.key()
    watch = ShardWatch(key_dir)
    assert watch.look() == ([1], [])
    shard = path_of(tmp_path, 1).parent
    mtime = shard.stat().st_mtime_ns
    assert time.time_ns() - mtime < RACY_NS  # just written: racy
    second = path_of(tmp_path, 2)  # the same shard
    assert second.parent == shard
    second.write_bytes(b"x")
    os.utime(shard, ns=(mtime, mtime))  # as if written in the same timestamp tick
    assert watch.look() == ([2], [])


class _CopyInFlight:
    """A host-tier transfer (host_tier.Transfer) that is done once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def ready(self) -> bool:
        return self.done


def _answers(reads: DiskReads, num: int) -> list[tuple[int, int, bool]]:
    got: list[tuple[int, int, bool]] = []
    deadline = time.monotonic() + 10
    while len(got) < num and time.monotonic() < deadline:
        reads.wait(0.5)
        got += reads.take()
    return got


def test_reads_on_a_hit_fill_slots_on_their_own_thread_and_answer_each_once(tmp_path, caplog):
    disk = written(tmp_path, [1, 2])
    slots = [memoryview(bytearray(PAYLOAD)) for _ in range(3)]
    copy = _CopyInFlight()
    reads = DiskReads(disk)
    reads.submit([(1, 0, slots[0]), (99, 1, slots[1]), (2, 2, slots[2])], after=[copy])
    time.sleep(0.05)
    assert reads.take() == [] and reads.pending and bytes(slots[0]) == bytes(PAYLOAD)  # a load may still read the slots
    copy.done = True
    assert _answers(reads, 3) == [(1, 0, True), (99, 1, False), (2, 2, True)]  # 99: no such file, a miss
    assert bytes(slots[0]) == block(1) and bytes(slots[2]) == block(2) and not reads.pending
    with caplog.at_level(logging.WARNING, logger="conveyor.gpu.kv.disk_reads"):
        reads.submit([(1, 0, memoryview(bytearray(10))), (2, 1, memoryview(bytearray(10)))], after=[])  # a bug: wrong sizes
        assert _answers(reads, 2) == [(1, 0, False), (2, 1, False)]  # still answered, as misses
    assert len(caplog.records) == 1
    reads.close()
    disk.close()
