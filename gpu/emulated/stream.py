"""VirtualStream: the emulated device's one compute stream, on the host's clock.

Work runs in launch order, back to back: a pass launched at host time t starts at max(t, the end
of the work before it) and takes its modelled seconds. Launching returns at once, so the host
runs ahead as it does with CUDA. An event recorded on the stream (`record`) completes when the
stream reaches that point: at max(now, the end of the work launched so far). Its `query()` asks
without blocking and `synchronize()` sleeps until then, as torch.cuda.Event's do; two events'
`seconds_until` is their elapsed time, so the pass clock (gpu/pass_clock.py) reads busy and idle
device time from them exactly as it reads CUDA events.

A pass's results come back through a VirtualCopy: an event recorded after the pass, whose tensors
(already in host memory: the emulated device keeps its tensors there) the runner may read only
once the stream has reached it, as a CUDA copy behind an event would land.

Clock and sleep are injectable, so tests drive the stream without waiting. time.sleep wakes
some tens of microseconds late on Linux; that lateness is the host's, as a real wait's would be.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from conveyor.gpu.pass_clock import Mark


class VirtualStream:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.clock, self._sleep = clock, sleep
        self.tail = -math.inf  # when the work launched so far ends

    def launch(self, seconds: float) -> None:
        """Queue `seconds` of device work behind what is queued; returns at once."""
        self.tail = max(self.clock(), self.tail) + seconds

    def record(self) -> VirtualEvent:
        """An event at this point of the stream: it completes when the work before it has."""
        return VirtualEvent(self, max(self.clock(), self.tail))

    def wait_until(self, at: float) -> None:
        remaining = at - self.clock()
        if remaining > 0:
            self._sleep(remaining)


class VirtualEvent:
    """A point on the virtual stream's timeline (a Mark for gpu/pass_clock.py)."""

    def __init__(self, stream: VirtualStream, at: float) -> None:
        self.stream, self.at = stream, at

    def query(self) -> bool:
        return self.stream.clock() >= self.at

    def synchronize(self) -> None:
        self.stream.wait_until(self.at)

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
