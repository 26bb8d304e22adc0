"""Reads from the KV disk tier into host slots on a hit (StepPlan.kv_fetches), on a thread of their
own so that the step never waits on the disk. Torch-free: a read fills a slot's bytes
(host_tier.py's block_bytes) through DiskTier.read_into, which checks each file's header, length
and CRC (a bad file is a miss, deleted, logged once).

Every read is answered once, read or missed, whatever happens (an error reading is a miss, logged
once): the scheduler keeps a read's slot out of its books until then. A read starts only after
the copies in flight that may touch its slot (a load of the plan before reading it, on a CUDA
side stream) are done. Answers are taken by the worker's loop (`take`), in the order the reads
finish; `wait` blocks until some are there (the in-process engine with nothing else to do).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.gpu.kv.disk_tier import DiskTier
    from conveyor.gpu.kv.host_tier import Transfer

log = logging.getLogger(__name__)

POLL_S = 0.0002  # how often a read waiting for a copy in flight looks again (a load takes about a millisecond)

Read = tuple[int, int, memoryview]  # (block name, host slot, the slot's bytes)


class DiskReads:
    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self._jobs: collections.deque[tuple[list[Read], list[Transfer]] | None] = collections.deque()
        self._done: list[tuple[int, int, bool]] = []  # (name, slot, read) answered, not taken yet
        self._num_pending = 0  # reads submitted and not answered
        self._cond = threading.Condition()
        self._logged = False
        self._thread = threading.Thread(target=self._loop, name="kv-disk-reader", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Whether some read is not taken yet (in flight, or answered)."""
        with self._cond:
            return self._num_pending > 0 or bool(self._done)

    def submit(self, reads: list[Read], after: Sequence[Transfer]) -> None:
        """Read each block into its slot, once the transfers `after` are done."""
        if not reads:
            return
        with self._cond:
            self._num_pending += len(reads)
            self._jobs.append((reads, list(after)))
            self._cond.notify_all()

    def take(self) -> list[tuple[int, int, bool]]:
        """The reads answered since the last call: (block name, slot, read and checked)."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def wait(self, timeout_s: float) -> None:
        """Block until a read is answered, or `timeout_s` passed, or none is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or not self._num_pending, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._jobs.append(None)
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs))
                job = self._jobs.popleft()
            if job is None:
                return
            reads, after = job
            ready = self._wait_for(after)
            for name, slot, view in reads:
                ok = ready and self._read(name, view)
                with self._cond:
                    self._num_pending -= 1
                    self._done.append((name, slot, ok))
                    self._cond.notify_all()

    def _wait_for(self, transfers: list[Transfer]) -> bool:
        """Polled, not waited on: the emulated device's `wait` counts a host spin-wait, which is
        the worker thread's to count."""
        try:
            for transfer in transfers:
                while not transfer.ready():
                    time.sleep(POLL_S)
        except Exception:  # the device failed: the reads are misses, the reader goes on
            self._log_failure()
            return False
        return True

    def _read(self, name: int, view: memoryview) -> bool:
        try:
            return self.disk.read_into(name, view)
        except Exception:  # a bug, or a buffer of the wrong size: a miss, the reader goes on
            self._log_failure()
            return False

    def _log_failure(self) -> None:
        if not self._logged:
            self._logged = True
            log.warning("KV disk tier: reading a block failed: a miss (further failures are not logged)", exc_info=True)
