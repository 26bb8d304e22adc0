"""VirtualStream: the emulated device's one compute stream, on the host's clock.

Work runs in launch order, back to back: a pass launched at host time t starts at max(t, the end
of the work before it) and takes its modelled seconds. Launching returns at once, so the host
runs ahead as it does with CUDA. An event recorded on the stream (`record`) completes when the
stream reaches that point: at max(now, the end of the work launched so far). Its `query()` asks
without blocking and `synchronize()` sleeps until then, as torch.cuda.Event's do; two events'
`seconds_until` is their elapsed time, so the pass clock (gpu/step/pass_clock.py) reads busy and idle
device time from them exactly as it reads CUDA events.

A pass's results come back through a VirtualCopy: an event recorded after the pass, whose tensors
(already in host memory: the emulated device keeps its tensors there) the runner may read only
once the stream has reached it, as a CUDA copy behind an event would land.

The host's side of the driver is modelled too, where the calibration table has it (gpu/emulated/
model.py decides how much): `hold` keeps the host busy for the CPU a launch costs a GPU host (a
graph replay, an eager forward's Python and launches), and `synchronize` waits as CUDA's default
spin-wait does. Neither burns this machine's CPU (two shared cores would lose it to the other
stages); both add to `modelled_cpu_s`, which the worker exports beside its /proc CPU.

Clock and sleep are injectable, so tests drive the stream without waiting. time.sleep wakes
some tens of microseconds late on Linux; that lateness is the host's, as a real wait's would be.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from conveyor.gpu.step.pass_clock import Mark


class VirtualStream:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.clock, self._sleep = clock, sleep
        self.tail = -math.inf  # when the work launched so far ends
        self.modelled_cpu_s = 0.0  # a GPU host's CPU in `hold` and `synchronize`, not spent here
        self.on_modelled_cpu: Callable[[float], None] | None = None  # told each addition (the worker's counter)
        self.spin_waits = False  # whether an event's synchronize counts as CPU (CUDA's spin on a GPU host)

    def launch(self, seconds: float, host_seconds: float = 0.0) -> None:
        """Queue `seconds` of device work behind what is queued; returns at once. `host_seconds`:
        how long the host takes to launch it (an eager forward's kernels, one by one): the work
        cannot end before the host has launched its last kernel. The caller holds the host that long."""
        now = self.clock()
        self.tail = max(max(now, self.tail) + seconds, now + host_seconds)

    def hold(self, seconds: float) -> None:
        """The host busy for `seconds` of a GPU host's CPU (modelled: this host sleeps)."""
        if seconds > 0:
            self._sleep(seconds)
            self._add_cpu(seconds)

    def _add_cpu(self, seconds: float) -> None:
        self.modelled_cpu_s += seconds
        if self.on_modelled_cpu is not None:
            self.on_modelled_cpu(seconds)

    def record(self) -> VirtualEvent:
        """An event at this point of the stream: it completes when the work before it has."""
        return VirtualEvent(self, max(self.clock(), self.tail))

    def wait_until(self, at: float, spins: bool = False) -> None:
        """Sleep until `at`; `spins`: CUDA would spin-wait there, so the wait is modelled CPU."""
        remaining = at - self.clock()
        if remaining > 0:
            self._sleep(remaining)
            if spins:
                self._add_cpu(remaining)


class VirtualEvent:
    """A point on the virtual stream's timeline (a Mark for gpu/step/pass_clock.py)."""

    def __init__(self, stream: VirtualStream, at: float) -> None:
        self.stream, self.at = stream, at

    def query(self) -> bool:
        return self.stream.clock() >= self.at

    def synchronize(self) -> None:
        self.stream.wait_until(self.at, spins=self.stream.spin_waits)

    def seconds_until(self, later: Mark) -> float:
        assert isinstance(later, VirtualEvent)
        return later.at - self.at


class VirtualCopy:
    """A pass's results on their way to the host: readable once the stream reaches `done`."""

    def __init__(self, tensors: list[Any], done: VirtualEvent) -> None:
        self.host, self.done = tensors, done

    def ready(self) -> bool:
        return self.done.query()

    def seconds_left(self) -> float:
        return max(0.0, self.done.at - self.done.stream.clock())

    def wait(self) -> list[Any]:
        self.done.synchronize()
        return self.host
